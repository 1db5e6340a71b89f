"""The replica processes of a DataParallelEngine: starting them, reading their messages, restarting the dead.

One `Replica` per data-parallel rank owns its process, the two pipes to it and a supervisor thread. The thread
reads the process's messages (outputs and stats for the engine thread, call results for their callers) until the
pipe closes, then reports the death (`ReplicaDied`, which ends that process's requests), and starts the replica
again on the same cores. A replica that fails to start again is retried after each of RESTART_DELAYS_S, then
given up ("failed").
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Callable

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError, EngineDeadError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.dp_replica import Call, CallResult, Outputs, Ready, Shutdown, StartFailed, recv, replica_main, send
from llmplug.engine.executors.worker_start import PRELOAD, START_METHOD_ENV, START_METHODS

__all__ = ["Replica", "ReplicaDied", "ReplicaState", "replica_context", "stop_all"]

logger = logging.getLogger(__name__)

# what the forkserver imports beside the workers' stack, when a replica starts it: the engine, the model layers,
# transformers' config and tokenizer classes (the seconds of a replica's start-up that are not its model's loading)
PRELOAD_MODULES = ["llmplug.engine.dp_replica", "llmplug.engine.llm_engine", "llmplug.layers.decoder",
                   "transformers.models.auto.configuration_auto", "transformers.models.auto.tokenization_auto"]
RESTART_DELAYS_S = (1.0, 5.0, 15.0)  # before each further attempt to restart a replica that fails to start
STOP_GRACE_S = 5.0  # a replica asked to leave has this long before it is terminated


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica as /health and the metrics show it."""

    index: int
    status: str  # "starting", "running", "restarting", "failed" (gave up restarting) or "stopped"
    pid: int | None
    cpus: tuple[int, ...]
    restarts: int
    last_error: str | None  # why it last died or failed to start
    stats: dict[str, Any]  # its engine's stats after its latest step


@dataclass(frozen=True, slots=True)
class ReplicaDied:
    """A replica process ended; `reason` says how."""

    reason: str


class Replica:
    """One replica: its process, its pipes, and the thread that reads its messages and restarts it."""

    def __init__(self, index: int, cpus: list[int], config: EngineConfig, registry: PluginRegistry,
                 events: queue.SimpleQueue):
        self.index, self.cpus, self.config, self.registry = index, cpus, config, registry
        self._events = events  # (index, generation, message) for the engine thread
        self._lock = threading.Lock()  # guards the fields below, read by other threads
        self.status = "starting"
        self.generation = 0
        self.process: Any = None
        self.restarts = 0
        self.last_error: str | None = None
        self.stats: dict[str, Any] = {}
        self.stats_version = 0  # counts stats updates: a reader merges them again only when one moved
        self.ready: Ready | None = None
        self._commands: Any = None
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._closing = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._supervise, name=f"llmplug-dp-replica-{index}", daemon=True)
        self._thread.start()

    # --- what the engine thread calls --------------------------------------------------------

    def wait_started(self) -> Ready:
        """The first start's Ready; its error when the replica could not start."""
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error
        return self.ready

    def serving(self) -> tuple[bool, int]:
        """(whether it takes requests now, the generation of its process)."""
        with self._lock:
            return self.status == "running", self.generation

    def send(self, message: Any, generation: int) -> None:
        """Send to the process of `generation`; dropped when that process is gone (its death fails its requests)."""
        with self._send_lock:
            if self._commands is None or self.generation != generation:
                return
            try:
                send(self._commands, message)
            except OSError:  # it died meanwhile: the supervisor reports it
                logger.debug("replica %d: dropped %s for a dead process", self.index, type(message).__name__)

    def call(self, function: Callable[..., Any], args: tuple) -> concurrent.futures.Future:
        """Run `function(engine, *args)` in the replica between its steps; the future gets its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.status != "running":
                raise EngineDeadError(f"data-parallel replica {self.index} is {self.status}")
            call_id, generation = next(self._call_ids), self.generation
            self._calls[call_id] = future
        self.send(Call(call_id, function, args), generation)
        return future

    def state(self) -> ReplicaState:
        with self._lock:
            pid = self.process.pid if self.process is not None else None
            return ReplicaState(self.index, self.status, pid, tuple(self.cpus), self.restarts, self.last_error,
                                dict(self.stats))

    def stop(self) -> None:
        """Ask the process to leave, then terminate and kill it; the supervisor ends with it."""
        with self._lock:
            self._closing = True
            process, generation = self.process, self.generation
        if process is None:
            return
        self.send(Shutdown(), generation)
        process.join(STOP_GRACE_S)
        for ending in (process.terminate, process.kill):
            if process.is_alive():
                ending()
                process.join(2)
        self._thread.join(STOP_GRACE_S)

    # --- the supervisor thread ---------------------------------------------------------------

    def _supervise(self) -> None:
        """Start the process, read its messages until it ends, report the end, start it again."""
        failed_starts = 0
        while True:
            events = self._spawn()
            started = self._read(events)
            reason = self._exit_reason()
            with self._lock:
                closing = self._closing
            if closing:
                self._set_status("stopped")
                return
            if not started:
                failed_starts += 1
                if self.ready is None or failed_starts > len(RESTART_DELAYS_S):  # first start, or gave up
                    self._give_up(reason)
                    return
                time.sleep(RESTART_DELAYS_S[failed_starts - 1])
            else:
                failed_starts = 0
                self._report_death(reason)
            with self._lock:
                self.restarts += 1

    def _spawn(self) -> Any:
        """Start a process (the next generation); return the pipe its messages come through."""
        context = replica_context(self.config)
        command_reader, command_writer = context.Pipe(duplex=False)
        event_reader, event_writer = context.Pipe(duplex=False)
        process = context.Process(
            target=replica_main,
            args=(self.config, self.registry, self.cpus, dict(os.environ), command_reader, event_writer),
            # a daemon process may not start processes: a replica with multiproc workers of its own is none; it is
            # stopped by stop_all (at exit too), or leaves when its command pipe closes
            name=f"llmplug-dp-replica-{self.index}", daemon=self.config.parallel.executor != "multiproc",
        )
        process.start()
        command_reader.close()  # the child's ends: its exit must close the pipes
        event_writer.close()
        with self._send_lock, self._lock:
            self.process, self._commands = process, command_writer
            self.generation += 1
        return event_reader

    def _read(self, events: Any) -> bool:
        """Handle the process's messages until its pipe closes; True when it had started."""
        started = False
        try:
            while True:
                message = recv(events)
                if isinstance(message, Outputs):
                    with self._lock:
                        self.stats = message.stats
                        self.stats_version += 1
                    self._events.put((self.index, self.generation, message))
                elif isinstance(message, CallResult):
                    self._resolve(message)
                elif isinstance(message, Ready):
                    started = True
                    self._on_ready(message)
                elif isinstance(message, StartFailed):
                    self._start_failed(message)
        except (EOFError, OSError):
            pass
        finally:
            events.close()
        return started

    def _on_ready(self, ready: Ready) -> None:
        with self._lock:
            self.status, self.stats = "running", ready.stats
            self.stats_version += 1
            first = self.ready is None
            self.ready = ready
        if first:
            self._started.set()
        else:
            logger.warning("data-parallel replica %d is serving again (pid %d)", self.index, ready.pid)

    def _start_failed(self, failed: StartFailed) -> None:
        with self._lock:
            self.last_error = f"{type(failed.error).__name__}: {failed.error}"
            if self.ready is None:
                self._start_error = failed.error
        logger.error("data-parallel replica %d failed to start:\n%s", self.index, failed.traceback)

    def _exit_reason(self) -> str:
        process = self.process
        process.join(STOP_GRACE_S)
        code = process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return f"data-parallel replica {self.index} (pid {process.pid}) exited ({how})"

    def _report_death(self, reason: str) -> None:
        """Its requests and calls fail; it is restarted (the caller loops)."""
        logger.error("%s; its in-flight requests failed; restarting it", reason)
        with self._lock:
            self.status, self.last_error, self.stats = "restarting", reason, {}
            self.stats_version += 1
            calls, self._calls = self._calls, {}
        self._events.put((self.index, self.generation, ReplicaDied(reason)))
        for future in calls.values():
            future.set_exception(EngineDeadError(reason))

    def _give_up(self, reason: str) -> None:
        with self._lock:
            self.status = "failed"
            self.last_error = self.last_error or reason
            if self._start_error is None and self.ready is None:
                self._start_error = EngineDeadError(f"{reason} before it was ready")
        self._started.set()
        self._events.put((self.index, self.generation, ReplicaDied(reason)))

    def _resolve(self, result: CallResult) -> None:
        with self._lock:
            future = self._calls.pop(result.call_id, None)
        if future is None:
            return
        if result.error is not None:
            future.set_exception(result.error)
        else:
            future.set_result(result.value)

    def _set_status(self, status: str) -> None:
        with self._lock:
            self.status = status


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


def stop_all(replicas: list[Replica]) -> None:
    """Stop every replica at once (each is given STOP_GRACE_S)."""
    threads = [threading.Thread(target=replica.stop, daemon=True) for replica in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
