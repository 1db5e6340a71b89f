"""The supervisors of a DataParallelEngine's replicas: reading their messages, watching them, restarting the dead.

One `Replica` per data-parallel rank owns the handle of its running replica (a process of the `mp` backend,
dp_process.py, or a Ray actor of the `ray` backend, dp_ray_replica.py: both a `ReplicaHandle`) and a supervisor
thread. The thread reads the replica's messages (outputs and stats for the engine thread, call results for their
callers) until it ends, then reports the end (`ReplicaDied`, which ends that replica's requests), and starts it
again. A replica that has work (requests, calls) and sends nothing for `parallel.engine_iteration_timeout_s`
(a busy replica sends its stats at least every second) is hung: it is killed, and so ends the same way. A replica
that fails to start again is retried after each of RESTART_DELAYS_S, then given up ("failed").
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from llmplug.core.config import EngineConfig
from llmplug.core.errors import EngineDeadError
from llmplug.engine.dp_replica import Call, CallResult, Outputs, Ready, StartFailed

__all__ = ["Replica", "ReplicaDied", "ReplicaHandle", "ReplicaLauncher", "ReplicaState", "stop_all"]

logger = logging.getLogger(__name__)

RESTART_DELAYS_S = (1.0, 5.0, 15.0)  # before each further attempt to restart a replica that fails to start
STOP_GRACE_S = 5.0  # a replica asked to leave has this long before it is killed
WATCH_S = 0.5  # how often a supervisor that hears nothing checks whether its replica is hung


class ReplicaHandle(Protocol):
    """One running replica as its supervisor uses it (`send` from any thread, the rest from the supervisor's)."""

    pid: int | None

    def send(self, message: Any) -> None:
        """Send a command (OSError once the replica is gone)."""

    def recv(self, timeout: float) -> Any | None:
        """The replica's next message, or None when none came within `timeout` s; EOFError once it ended."""

    def kill(self) -> None:
        """End the replica now, whatever it is doing."""

    def exit_reason(self, grace_s: float) -> str:
        """How the ended replica ended, naming it (`data-parallel replica 1 (pid 42) exited (...)`)."""

    def stop(self, grace_s: float) -> None:
        """Ask the replica to leave (Shutdown), and end it when it has not within `grace_s`."""


class ReplicaLauncher(Protocol):
    """A data-parallel backend: starts replicas (`parallel.data_parallel_backend`)."""

    cpus: list[list[int]]  # the cores of each replica ([] each where the backend places them)

    def launch(self, index: int, config: EngineConfig) -> ReplicaHandle:
        """Start replica `index` (at the first start and at each restart); its first message is Ready or
        StartFailed."""

    def close(self) -> None:
        """Release what the backend holds, once every replica stopped."""


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
    """One replica: its running handle, and the thread that reads its messages, watches it and restarts it."""

    def __init__(self, index: int, launcher: ReplicaLauncher, config: EngineConfig, events: queue.SimpleQueue):
        self.index, self.launcher, self.config = index, launcher, config
        self.cpus = launcher.cpus[index]
        self.timeout_s = config.parallel.engine_iteration_timeout_s
        self._events = events  # (index, generation, message) for the engine thread
        self._lock = threading.Lock()  # guards the fields below, read by other threads
        self.status = "starting"
        self.generation = 0
        self.handle: ReplicaHandle | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self.stats: dict[str, Any] = {}
        self.stats_version = 0  # counts stats updates: a reader merges them again only when one moved
        self.ready: Ready | None = None
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._has_requests = False
        self._silent_since = time.monotonic()  # the last message, or work given to a replica that had none
        self._hung: str | None = None  # why the supervisor killed the current handle
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
        """Send to the replica of `generation`; dropped when it is gone (its death fails its requests)."""
        with self._send_lock:
            if self.handle is None or self.generation != generation:
                return
            try:
                self.handle.send(message)
            except (OSError, EOFError):  # it died meanwhile: the supervisor reports it
                logger.debug("replica %d: dropped %s for a dead replica", self.index, type(message).__name__)

    def has_requests(self, busy: bool) -> None:
        """The front end now has (`busy`) or no longer has unfinished requests in this replica: a busy replica
        that stays silent for timeout_s is hung."""
        with self._lock:
            if busy and not self._has_requests:
                self._silent_since = time.monotonic()
            self._has_requests = busy

    def call(self, function: Callable[..., Any], args: tuple) -> concurrent.futures.Future:
        """Run `function(engine, *args)` in the replica between its steps; the future gets its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.status != "running":
                raise EngineDeadError(f"data-parallel replica {self.index} is {self.status}")
            call_id, generation = next(self._call_ids), self.generation
            if not self._calls and not self._has_requests:
                self._silent_since = time.monotonic()
            self._calls[call_id] = future
        self.send(Call(call_id, function, args), generation)
        return future

    def state(self) -> ReplicaState:
        with self._lock:
            pid = self.handle.pid if self.handle is not None else None
            return ReplicaState(self.index, self.status, pid, tuple(self.cpus), self.restarts, self.last_error,
                                dict(self.stats))

    def stop(self) -> None:
        """Ask the replica to leave, then end it; the supervisor ends with it."""
        with self._lock:
            self._closing = True
            handle = self.handle
        if handle is not None:
            handle.stop(STOP_GRACE_S)
        self._thread.join(STOP_GRACE_S)

    # --- the supervisor thread ---------------------------------------------------------------

    def _supervise(self) -> None:
        """Start the replica, read its messages until it ends, report the end, start it again."""
        failed_starts = 0
        while True:
            try:
                handle = self._launch()
            except Exception as error:  # noqa: BLE001 - the backend could not start it: as a failed start
                reason = f"data-parallel replica {self.index} could not be launched: {error}"
                self._start_failed(StartFailed(error, reason))
                started = False
            else:
                started = self._read(handle)
                exited = handle.exit_reason(STOP_GRACE_S)  # also reaps what is left of it
                reason = self._hung or exited
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

    def _launch(self) -> ReplicaHandle:
        """Start the next generation of the replica."""
        handle = self.launcher.launch(self.index, self.config)
        with self._send_lock, self._lock:
            self.handle, self._hung = handle, None
            self.generation += 1
            closing = self._closing
        if closing:  # stop() came while it started: it found no handle to stop
            handle.stop(STOP_GRACE_S)
        return handle

    def _read(self, handle: ReplicaHandle) -> bool:
        """Handle the replica's messages until it ends (or is killed as hung); True when it had started."""
        started = False
        try:
            while True:
                message = handle.recv(WATCH_S)
                if message is None:
                    self._check_hung(handle)
                    continue
                with self._lock:
                    self._silent_since = time.monotonic()
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
        except EOFError:
            pass
        return started

    def _check_hung(self, handle: ReplicaHandle) -> None:
        """Kill a serving replica that has work and stayed silent for timeout_s (it then ends as dead ones do)."""
        with self._lock:
            busy = self.status == "running" and (self._has_requests or bool(self._calls))
            silent = time.monotonic() - self._silent_since
            if not busy or silent < self.timeout_s or self._hung is not None:
                return
            self._hung = (f"data-parallel replica {self.index} (pid {handle.pid}) made no progress for {silent:.0f} s "
                          f"(parallel.engine_iteration_timeout_s = {self.timeout_s:g}): declared hung and killed")
        logger.error("%s", self._hung)
        handle.kill()

    def _on_ready(self, ready: Ready) -> None:
        with self._lock:
            self.status, self.stats = "running", ready.stats
            self.stats_version += 1
            if self.handle is not None:
                self.handle.pid = ready.pid
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


def stop_all(replicas: list[Replica]) -> None:
    """Stop every replica at once (each is given STOP_GRACE_S)."""
    threads = [threading.Thread(target=replica.stop, daemon=True) for replica in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
