"""The `mp` data-parallel backend: each replica a process of this machine, pinned to its share of the cores.

`ProcessLauncher.launch` starts one replica process (`dp_replica.replica_main`) with two pipes; the
`ProcessHandle` it returns is what the replica's supervisor (dp_supervisor.py) sends through, reads from and
ends. Replicas fork from the workers' forkserver, or are spawned (see `replica_context`).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.dp_placement import replica_cpus
from llmplug.engine.dp_replica import Shutdown, recv, replica_main, send
from llmplug.engine.executors.worker_start import PRELOAD, START_METHOD_ENV, START_METHODS

__all__ = ["ProcessHandle", "ProcessLauncher", "replica_context"]

# what the forkserver imports beside the workers' stack, when a replica starts it: the engine, the model layers,
# transformers' config and tokenizer classes (the seconds of a replica's start-up that are not its model's loading)
PRELOAD_MODULES = ["llmplug.engine.dp_replica", "llmplug.engine.llm_engine", "llmplug.layers.decoder",
                   "transformers.models.auto.configuration_auto", "transformers.models.auto.tokenization_auto"]


class ProcessHandle:
    """One replica process and its pipes, as its supervisor uses them (the supervisor thread only reads)."""

    def __init__(self, index: int, process: Any, commands: Connection, events: Connection):
        self.index, self.process, self.pid = index, process, process.pid
        self._commands, self._events = commands, events

    def send(self, message: Any) -> None:
        """Send a message (OSError once the process is gone)."""
        send(self._commands, message)

    def recv(self, timeout: float) -> Any | None:
        """The next message, or None when none came within `timeout` s; EOFError once the process ended."""
        try:
            if not self._events.poll(timeout):
                return None
            return recv(self._events)
        except OSError as error:
            raise EOFError(str(error)) from error

    def kill(self) -> None:
        """End the process now (SIGKILL ends a stopped process too)."""
        if self.process.is_alive():
            self.process.kill()

    def exit_reason(self, grace_s: float) -> str:
        """How the process ended (waiting up to `grace_s` for it to)."""
        self._events.close()
        self.process.join(grace_s)
        code = self.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return f"data-parallel replica {self.index} (pid {self.pid}) exited ({how})"

    def stop(self, grace_s: float) -> None:
        """Ask the process to leave, then terminate and kill it."""
        try:
            self.send(Shutdown())
        except OSError:
            pass  # gone already
        self.process.join(grace_s)
        for ending in (self.process.terminate, self.process.kill):
            if self.process.is_alive():
                ending()
                self.process.join(2)


class ProcessLauncher:
    """Starts replica processes on this machine, each pinned to its share of the cores (dp_placement.py)."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry):
        self.config, self.registry = config, registry
        self.cpus = replica_cpus(config.parallel.data_parallel_size)

    def launch(self, index: int, config: EngineConfig) -> ProcessHandle:
        """Start replica `index`'s process (a new one at each restart, on the same cores)."""
        context = replica_context(config)
        command_reader, command_writer = context.Pipe(duplex=False)
        event_reader, event_writer = context.Pipe(duplex=False)
        process = context.Process(
            target=replica_main,
            args=(config, self.registry, self.cpus[index], dict(os.environ), command_reader, event_writer),
            # a daemon process may not start processes: a replica with multiproc workers of its own is none; it is
            # stopped by stop_all (at exit too), or leaves when its command pipe closes
            name=f"llmplug-dp-replica-{index}", daemon=config.parallel.executor != "multiproc",
        )
        process.start()
        command_reader.close()  # the child's ends: its exit must close the pipes
        event_writer.close()
        return ProcessHandle(index, process, command_writer, event_reader)

    def close(self) -> None:
        """Nothing to release: each process was stopped by its handle."""


def replica_context(config: EngineConfig) -> BaseContext:
    """How replica processes start: forked from the workers' forkserver (worker_start.py), which imported torch,
    transformers and the engine once, so a new or restarted replica starts in about the time its model takes to
    load. That torch loaded with OMP_WAIT_POLICY=PASSIVE; a replica of one worker running several threads on
    cores of its own wants ACTIVE, which only a fresh interpreter can take: it is spawned
    (VLLM_WORKER_MULTIPROC_METHOD=spawn spawns every replica)."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in START_METHODS:
        raise ConfigError(f"{START_METHOD_ENV}={method!r}: data-parallel replicas start by "
                          f"{' or '.join(START_METHODS)} (a fork of this process would copy its threads)")
    parallel = config.parallel
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1 and (config.device.num_threads or 1) > 1:
        method = "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload([PRELOAD, *PRELOAD_MODULES])  # when the forkserver starts (once)
    return multiprocessing.get_context(method)
