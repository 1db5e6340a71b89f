"""The worker process of the multiproc executor, and the messages it exchanges with the engine.

The engine broadcasts `RpcCall`s (and finally `Shutdown`) through one MessageQueue; each worker
answers every call with a `Reply` through its own queue. This module imports no torch at import
time: a spawned process must configure its CPU threads before torch loads (see
platforms/cpu_threads.py), so `worker_main` does that first and imports the engine afterwards (a
worker forked from the forkserver, worker_start.py, has torch loaded under the workers' policy already).
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import traceback
from dataclasses import dataclass, field
from typing import Any

from llmplug.communicators.shm_broadcast import MessageQueue, MessageQueueHandle
from llmplug.core.config import EngineConfig
from llmplug.core.errors import EngineDeadError
from llmplug.core.plugins import PluginRegistry

__all__ = ["Reply", "RpcCall", "Shutdown", "WorkerSpec", "worker_main"]


@dataclass(frozen=True, slots=True)
class RpcCall:
    """Call `method` (a Worker method's name or a picklable function of the worker) on every worker."""

    method: Any
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Leave the loop, the process groups and the process."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A worker's answer: the value, or the exception it raised (with its traceback as text)."""

    value: Any = None
    error: BaseException | None = None
    traceback: str = ""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Where a worker sits and how it reaches the engine and the other workers (plain values only:
    unpickling it must not import torch)."""

    rank: int
    local_rank: int
    world_size: int
    init_method: str
    calls: MessageQueueHandle
    replies: MessageQueueHandle
    environ: dict[str, str]  # the engine's environment when it started the workers


def worker_main(config: EngineConfig, spec: WorkerSpec, registry: PluginRegistry) -> None:
    """Entry point of a worker process: set up, then answer calls until `Shutdown` or the engine dies."""
    from llmplug.engine.executors.worker_start import adopt_engine_environment
    from llmplug.platforms.cpu_threads import configure_cpu_threads

    adopt_engine_environment(spec.environ)

    # Ctrl-C reaches the whole process group: the engine handles it and shuts the workers down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_cpu_threads(config.device.num_threads, num_processes_sharing=spec.world_size)
    calls = MessageQueue.attach(spec.calls, reader=spec.rank)
    replies = MessageQueue.attach(spec.replies)
    parent = multiprocessing.parent_process()

    def engine_alive() -> None:
        if parent is not None and not parent.is_alive():
            raise EngineDeadError(f"worker rank {spec.rank}: the engine process (pid {parent.pid}) is gone")

    worker = None
    try:
        worker = _start_worker(config, spec, registry)
        replies.enqueue(Reply(value=worker.rank), check_alive=engine_alive)
        _serve(worker, calls, replies, engine_alive)
    except EngineDeadError:
        pass  # nobody is left to answer
    except BaseException as error:  # a start-up failure: the engine shows it, then stops every worker
        replies.enqueue(_failure(error), timeout=5, check_alive=engine_alive)
    finally:
        if worker is not None:
            worker.shutdown()
        calls.close()
        replies.close()


def _start_worker(config: EngineConfig, spec: WorkerSpec, registry: PluginRegistry) -> Any:
    """The Worker of this rank, in its process groups, with the model loaded."""
    from llmplug.communicators.parallel_state import DistributedEnv
    from llmplug.engine.worker import Worker

    env = DistributedEnv(spec.world_size, spec.rank, spec.local_rank, spec.init_method)
    worker = Worker(config, env, registry)
    worker.init_device()
    worker.load_model()
    return worker


def _serve(worker: Any, calls: MessageQueue, replies: MessageQueue, engine_alive: Any) -> None:
    """Answer each call with a Reply until Shutdown."""
    from llmplug.engine.executors.base import run_worker_method

    while not isinstance(call := calls.dequeue(check_alive=engine_alive), Shutdown):
        try:
            reply = Reply(value=run_worker_method(worker, call.method, call.args, call.kwargs))
        except Exception as error:  # the engine re-raises it; this worker keeps serving
            reply = _failure(error)
        replies.enqueue(reply, check_alive=engine_alive)


def _failure(error: BaseException) -> Reply:
    """A Reply carrying `error` itself when it survives pickling, else a RuntimeError with its text."""
    text = "".join(traceback.format_exception(error))
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    return Reply(error=error, traceback=text)
