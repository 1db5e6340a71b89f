"""The uniproc executor: one worker, in the engine's own process."""

from __future__ import annotations

from typing import Any

from llmplug.core.errors import ConfigError
from llmplug.engine.executors.base import Executor, WorkerMethod, run_worker_method
from llmplug.engine.worker import Worker


class UniprocExecutor(Executor):
    """Runs a single Worker in this process (no IPC in the hot path)."""

    def _init_workers(self) -> None:
        tp, pp = self.config.parallel.tensor_parallel_size, self.config.parallel.pipeline_parallel_size
        if tp * pp != 1:
            raise ConfigError(
                f"parallel.executor 'uniproc' runs one worker, but tensor_parallel_size={tp} x "
                f"pipeline_parallel_size={pp} needs more: use multiproc or ray"
            )
        self.worker = Worker(self.config, registry=self.registry)
        self.worker.init_device()
        self.worker.load_model()

    @property
    def output_rank(self) -> int:
        """The only worker."""
        return 0

    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [run_worker_method(self.worker, method, args, kwargs)]

    def execute_model(self, scheduler_output):  # noqa: D102 - skip the list round trip in the hot path
        return self.worker.execute_model(scheduler_output)
