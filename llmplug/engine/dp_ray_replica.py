"""The `ray` data-parallel backend: each replica a Ray actor, placed by Ray.

The front end joins the Ray cluster at `parallel.ray_address` (else RAY_ADDRESS, else the one this process
already uses, else a new local one; as the Ray executor does) and starts one `RayReplicaActor` per replica,
reserving `num_cpus` = the replica's threads (`device.num_threads` x its workers; default: this machine's cores
/ data_parallel_size). Ray chooses the node; cores are not pinned. In the actor a thread runs the replica exactly
as a replica process runs it (`dp_replica.serve_replica`), over two in-process queues instead of pipes: the
front end `put`s commands (numbered: a threaded actor may run two calls out of order) and long-polls `take` for
messages. An actor that dies (`ray.kill`, its node lost) ends its replica like a dead process; it is then killed
for good (freeing its CPUs) and a new actor is started.
"""

from __future__ import annotations

import collections
import itertools
import logging
import pickle
import queue
import sys
import threading
import time
import traceback
from typing import Any

import ray
from ray.exceptions import RayActorError

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.dp_replica import Shutdown, serve_replica
from llmplug.platforms.cpu_threads import available_cpu_count
from llmplug.plugins.executors.ray import _join_ray, _leave_ray

__all__ = ["QueueConnection", "RayLauncher", "RayReplicaActor", "RayReplicaHandle"]

logger = logging.getLogger(__name__)

ACTOR_CONCURRENCY = 4  # the actor's threads for calls: one long-polling take, puts, `ended`
_CLOSED = object()


class QueueConnection:
    """One direction of a pipe between two threads (what serve_replica uses of a Connection)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._closed = False

    def send_bytes(self, data: bytes) -> None:
        self._queue.put(data)

    def poll(self, timeout: float = 0.0) -> bool:
        """True when a message (or the end) is waiting, waiting up to `timeout` s for one."""
        deadline = time.monotonic() + timeout
        while self._queue.empty() and time.monotonic() < deadline:
            time.sleep(min(0.001, timeout))
        return not self._queue.empty()

    def recv_bytes(self) -> bytes:
        """The next message (blocking); EOFError once the other side closed."""
        item = self._queue.get()
        if item is _CLOSED:
            self._queue.put(_CLOSED)  # every later call ends too
            raise EOFError("the other side closed")
        return item

    def take(self, timeout: float) -> tuple[list[bytes], bool]:
        """(the messages waiting, waiting up to `timeout` s for the first; whether the other side closed)."""
        try:
            items = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return [], False
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        closed = any(item is _CLOSED for item in items)
        return [item for item in items if item is not _CLOSED], closed

    def close(self) -> None:
        self._queue.put(_CLOSED)


class RayReplicaActor:
    """A replica inside a Ray actor (`ray.remote` wraps this class): serve_replica in a thread of its own."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry, num_threads: int):
        if "torch" not in sys.modules:
            from llmplug.platforms.cpu_threads import configure_cpu_threads

            parallel = config.parallel
            configure_cpu_threads(num_threads,
                                  num_processes_sharing=parallel.tensor_parallel_size * parallel.pipeline_parallel_size)
        self._commands, self._events = QueueConnection(), QueueConnection()
        self._order = threading.Lock()
        self._next, self._early = 0, {}  # the next command's number; commands that came before an earlier one
        self._ended: str | None = None
        threading.Thread(target=self._run, args=(config, registry), name="llmplug-dp-replica", daemon=True).start()

    def _run(self, config: EngineConfig, registry: PluginRegistry) -> None:
        try:
            serve_replica(config, registry, self._commands, self._events)
            self._ended = "left"
        except BaseException as error:  # noqa: BLE001 - a step's exception ends the replica; the front end says why
            self._ended = f"ended by {type(error).__name__}: {error}"
            logger.error("data-parallel replica failed:\n%s", "".join(traceback.format_exception(error)))
        finally:
            self._events.close()

    def put(self, number: int, data: bytes) -> None:
        """Command number `number` (pickled): handed to the replica in the order of the numbers."""
        with self._order:
            self._early[number] = data
            while self._next in self._early:
                self._commands.send_bytes(self._early.pop(self._next))
                self._next += 1

    def take(self, timeout: float) -> tuple[list[bytes], bool]:
        """The replica's messages (pickled) since the last call, waiting up to `timeout` s for the first, and
        whether the replica ended."""
        return self._events.take(timeout)

    def ended(self) -> str | None:
        """How the replica ended (None while it runs)."""
        return self._ended


class RayReplicaHandle:
    """One replica's Ray actor, as its supervisor uses it (the supervisor thread alone calls recv)."""

    def __init__(self, index: int, actor: Any):
        self.index, self.actor, self.pid = index, actor, None
        self._numbers = itertools.count()
        self._numbers_lock = threading.Lock()
        self._pending: collections.deque = collections.deque()
        self._take: Any = None  # the take call in flight: at most one, so no late answer is lost
        self._closed = False
        self._died: str | None = None

    def send(self, message: Any) -> None:
        """Send a command (the call is not waited for: a dead actor's end reaches recv)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._numbers_lock:
            self.actor.put.remote(next(self._numbers), data)

    def recv(self, timeout: float) -> Any | None:
        """The next message, or None when none came within `timeout` s; EOFError once the replica ended."""
        if not self._pending and not self._closed:
            self._poll(timeout)
        if self._pending:
            return self._pending.popleft()
        if self._closed:
            raise EOFError(self._died or "the replica ended")
        return None

    def _poll(self, timeout: float) -> None:
        if self._take is None:
            self._take = self.actor.take.remote(timeout)
        ready, _ = ray.wait([self._take], timeout=timeout)
        if not ready:  # the actor does not answer (stopped, or busy past the timeout): the same call next time
            return
        take, self._take = self._take, None
        try:
            messages, self._closed = ray.get(take)
        except RayActorError as error:
            self._closed, self._died = True, _actor_death(error)
            return
        self._pending.extend(pickle.loads(data) for data in messages)

    def kill(self) -> None:
        """Kill the actor now (its pending calls fail: recv then ends)."""
        ray.kill(self.actor, no_restart=True)

    def exit_reason(self, grace_s: float) -> str:
        """How the replica ended; the actor is killed for good after (its CPUs go back to the cluster)."""
        how = self._died
        if how is None:
            try:
                how = ray.get(self.actor.ended.remote(), timeout=grace_s) or "ended"
            except (RayActorError, ray.exceptions.GetTimeoutError) as error:
                how = _actor_death(error)
        self.kill()
        return f"data-parallel replica {self.index} (Ray actor, pid {self.pid}) {how}"

    def stop(self, grace_s: float) -> None:
        """Ask the replica to leave; kill the actor once it has (its supervisor saw the end) or after `grace_s`."""
        try:
            self.send(Shutdown())
        except RayActorError:
            pass
        deadline = time.monotonic() + grace_s
        while not self._closed and time.monotonic() < deadline:
            time.sleep(0.01)
        self.kill()


def _actor_death(error: BaseException) -> str:
    """A short account of a Ray actor's death (Ray's own message runs over many lines)."""
    text = str(error)
    if "ray.kill" in text:
        return "died (its Ray actor was killed by ray.kill)"
    return f"died (its Ray actor: {text.strip().splitlines()[0] if text.strip() else type(error).__name__})"


class RayLauncher:
    """Starts replicas as Ray actors of `num_cpus` each, on the cluster the config names (or a local one)."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry):
        self.registry = registry
        parallel = config.parallel
        workers = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self.num_threads = config.device.num_threads or max(
            1, available_cpu_count() // (parallel.data_parallel_size * workers))
        self.num_cpus = self.num_threads * workers
        self.cpus: list[list[int]] = [[] for _ in range(parallel.data_parallel_size)]  # Ray places, nothing pinned
        _join_ray(parallel.ray_address)
        try:
            self._check_capacity(parallel.data_parallel_size)
        except ConfigError:
            _leave_ray()
            raise
        self._actor_class = ray.remote(RayReplicaActor)

    def _check_capacity(self, num_replicas: int) -> None:
        """A cluster with fewer CPUs than the replicas reserve would leave some waiting forever: refuse it."""
        total = ray.cluster_resources().get("CPU", 0)
        if total < self.num_cpus * num_replicas:
            raise ConfigError(
                f"{num_replicas} data-parallel Ray replicas of {self.num_cpus} CPU(s) each need "
                f"{self.num_cpus * num_replicas} CPUs; the Ray cluster has {total:g}. Lower device.num_threads or "
                "data_parallel_size, or join a larger cluster (parallel.ray_address).")

    def launch(self, index: int, config: EngineConfig) -> RayReplicaHandle:
        """A new actor for replica `index`, wherever Ray finds num_cpus free."""
        config = config.model_copy(deep=True)
        config.device.num_threads = self.num_threads  # the worker's threads are those Ray reserved, not the node's
        actor = self._actor_class.options(num_cpus=self.num_cpus, max_concurrency=ACTOR_CONCURRENCY).remote(
            config, self.registry, self.num_threads)
        return RayReplicaHandle(index, actor)

    def close(self) -> None:
        """Leave the Ray cluster (and stop it when the engine started it)."""
        _leave_ray()
