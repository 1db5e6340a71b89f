"""The executor interface the engine core talks to."""

from __future__ import annotations

import abc
import socket
from typing import Any, Callable

from llmplug.core.config import EngineConfig, ParallelConfig
from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

# what collective_rpc runs: a Worker method's name, or a picklable function called as fn(worker, ...)
WorkerMethod = str | Callable[..., Any]


def run_worker_method(worker: Any, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> Any:
    """Call `method` on `worker`: `worker.<method>(*args, **kwargs)`, or `method(worker, *args, **kwargs)`."""
    if isinstance(method, str):
        func = getattr(worker, method, None)
        if func is None:
            raise AttributeError(f"{type(worker).__name__} has no method {method!r} to call on every worker")
        return func(*args, **(kwargs or {}))
    return method(worker, *args, **(kwargs or {}))


def check_one_replica(parallel: ParallelConfig, executor: str) -> int:
    """The number of workers of one engine (TP x PP); data parallelism runs separate engines (replicas)."""
    if parallel.data_parallel_size != 1:
        raise ConfigError(
            f"parallel.data_parallel_size={parallel.data_parallel_size} with executor {executor!r}: an LLMEngine is "
            "one replica; LLM, AsyncLLM and `llmplug serve` start data_parallel_size replicas themselves "
            "(docs/data_parallel.md), or use the external launcher"
        )
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Executor(abc.ABC):
    """Runs the same method on every worker; the output rank's result is the engine's.

    `registry` is the engine's plugin registry: workers in this process use it as is, workers in other
    processes get a copy (the same allow-list and preferences). Default: the one `config.plugins` builds.
    """

    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None):
        self.config = config
        self.registry = registry or PluginRegistry.from_config(config.plugins)
        self._init_workers()

    @abc.abstractmethod
    def _init_workers(self) -> None:
        """Start the workers (processes, actors or an in-process object)."""

    @abc.abstractmethod
    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call `method` (a Worker method's name, or a picklable `fn(worker, *args, **kwargs)`) on every
        worker with picklable arguments; return their results in rank order."""

    @property
    def output_rank(self) -> int:
        """The rank whose step output the engine uses: the first rank of the last pipeline stage."""
        parallel = self.config.parallel
        return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all workers; the output rank's result is the step's (with every worker's KV connector
        report: a load may fail on any rank)."""
        outputs = self.collective_rpc("execute_model", (scheduler_output,))
        output = outputs[self.output_rank]
        if scheduler_output.kv_connector_metadata is not None:
            from llmplug.engine.kv_transfer import merge_outputs

            merge_outputs(outputs, output)
        return output

    def determine_num_blocks(self) -> int:
        """The KV blocks every worker can hold."""
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache on every worker."""
        self.collective_rpc("initialize_cache", (num_blocks,))

    def shutdown(self) -> None:
        """Stop the workers and release their resources."""
