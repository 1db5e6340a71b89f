"""The multiproc executor: one worker process per rank, on this node.

Each call (every step's scheduler output included) is broadcast to all workers through one
shared-memory MessageQueue; each worker answers through its own queue. The ranks meet over
torch.distributed at `parallel.distributed_init_method` (default: a free port on 127.0.0.1).
Workers are forked from a forkserver that imported the worker stack once (worker_start.py; or spawned), and
either way each imports the user's script again: created from a script's top level outside
`if __name__ == "__main__":`, the executor refuses at once with StartupError (main_guard.py).

Failure handling: while waiting, the executor checks every 0.1 s that its workers are alive; a dead
worker fails the call with EngineDeadError naming its rank, pid and exit code, and every later call
fails the same way. An exception in a worker is re-raised in the engine (same type, the worker's
traceback as its cause); when only some ranks fail and the others do not answer within a few
seconds (stuck in a collective), the executor is dead too. `shutdown` (also run when the executor
is garbage-collected or the interpreter exits) asks the workers to leave, then terminates and kills
whatever is left, so no process outlives the engine.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import weakref
from typing import Any, Collection

from llmplug.communicators.shm_broadcast import MessageQueue, wait_any
from llmplug.core.errors import EngineDeadError
from llmplug.engine.executors.base import Executor, WorkerMethod, check_one_replica, free_local_port
from llmplug.engine.executors.main_guard import check_main_guard
from llmplug.engine.executors.multiproc_worker import Reply, RpcCall, Shutdown, WorkerSpec, worker_main
from llmplug.engine.executors.worker_start import worker_context

__all__ = ["MultiprocExecutor", "WorkerTraceback"]

logger = logging.getLogger(__name__)

# after one rank fails, how long the others may take to answer before they count as stuck
PARTIAL_FAILURE_GRACE_S = 5.0


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker process (the cause of the re-raised error)."""


class MultiprocExecutor(Executor):
    """Workers in their own processes; calls broadcast over shared memory."""

    def _init_workers(self) -> None:
        parallel = self.config.parallel
        self.world_size = check_one_replica(parallel, "multiproc")
        check_main_guard(f"{self.world_size} worker processes")  # before any process exists: fail at once
        init_method = parallel.distributed_init_method or f"tcp://127.0.0.1:{free_local_port()}"
        self.calls = MessageQueue.create(num_readers=self.world_size)
        self.replies = [MessageQueue.create(num_readers=1, reader=0) for _ in range(self.world_size)]
        self.dead: str | None = None
        context = worker_context(self.world_size)
        environ = dict(os.environ)
        self.procs = []
        for rank in range(self.world_size):
            spec = WorkerSpec(rank, rank, self.world_size, init_method, self.calls.handle, self.replies[rank].handle,
                              environ)
            proc = context.Process(
                target=worker_main, args=(self.config, spec, self.registry), name=f"llmplug-worker-{rank}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.calls, self.replies)
        try:
            self._gather("start-up")
        except BaseException:
            self.shutdown()
            raise

    # ---- calls ----
    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self.calls.enqueue(RpcCall(method, tuple(args), dict(kwargs or {})), check_alive=self._check_workers)
        return self._gather(method if isinstance(method, str) else getattr(method, "__name__", repr(method)))

    def _gather(self, what: str) -> list[Any]:
        """Every worker's reply, in rank order; raises the first error (by arrival)."""
        replies: dict[int, Reply] = {}
        failed: tuple[int, Reply] | None = None
        while len(replies) < self.world_size:
            pending = [rank for rank in range(self.world_size) if rank not in replies]
            timeout = PARTIAL_FAILURE_GRACE_S if failed else None
            # a worker that reported its failure may end (a failed start-up does): only the others must run
            answered_with_error = {rank for rank, reply in replies.items() if reply.error is not None}
            try:
                index = wait_any(
                    [self.replies[r] for r in pending], timeout, lambda: self._check_workers(answered_with_error)
                )
            except TimeoutError:
                self.dead = f"worker ranks {pending} stopped answering after rank {failed[0]} failed in {what}"
                break
            rank = pending[index]
            replies[rank] = self.replies[rank].dequeue()
            if replies[rank].error is not None and failed is None:
                failed = (rank, replies[rank])
        if failed is not None:
            rank, reply = failed
            raise reply.error from WorkerTraceback(f"in worker rank {rank} ({what}):\n{reply.traceback}")
        return [replies[rank].value for rank in range(self.world_size)]

    def _check_workers(self, expected_to_end: Collection[int] = ()) -> None:
        """EngineDeadError naming the first worker (not in `expected_to_end`) that is no longer running."""
        for rank, proc in enumerate(self.procs):
            if rank not in expected_to_end and not proc.is_alive():
                self.dead = (
                    f"worker rank {rank} (pid {proc.pid}) exited unexpectedly ({_describe_exit(proc.exitcode)}); "
                    "the engine cannot continue: shut it down and start a new one"
                )
                raise EngineDeadError(self.dead)

    # ---- lifetime ----
    def shutdown(self) -> None:
        """Stop every worker (asking first, then by signal) and remove the shared memory."""
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers, in rank order."""
        return [proc.pid for proc in self.procs]


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _stop_workers(procs: list, calls: MessageQueue, replies: list[MessageQueue]) -> None:
    """Ask the workers to leave (when all still run), then terminate and kill the rest; free the queues."""
    if all(proc.is_alive() for proc in procs):
        try:
            calls.enqueue(Shutdown(), timeout=2)
            deadline = time.monotonic() + 5
            for proc in procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            logger.warning("workers did not take the shutdown message; terminating them")
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=2)
        if proc.is_alive():
            proc.kill()
        proc.join()
    for queue in (calls, *replies):
        queue.close()
