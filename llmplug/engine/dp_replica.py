"""A data-parallel replica's serving loop, and the messages it exchanges with `DataParallelEngine`.

A replica is a whole LLMEngine (its executor as configured: one worker, or tensor/pipeline-parallel workers of
its own) in a process pinned to its share of the cores (`replica_main`, the mp backend), or in a thread of a Ray
actor (`serve_replica`, the ray backend: dp_ray_replica.py). It runs AsyncLLM's loop without the asyncio side:
between steps it takes every queued command, with nothing to run it blocks on its commands, and after each step
it sends the step's outputs and its stats (while it has requests, at least every HEARTBEAT_S: its supervisor
takes a longer silence for a hang). Messages are pickled by hand (`send_bytes`), so a tensor in an output travels
as bytes, not as a shared-memory handle. The replica leaves when told to, or when its commands end (the front
end is gone). This module imports no torch at import time: a spawned replica pins itself and configures its CPU
threads first (platforms/cpu_threads.py).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

from llmplug.core.config import EngineConfig
from llmplug.core.plugins import PluginRegistry

__all__ = ["AddRequest", "AbortRequests", "Call", "CallResult", "Outputs", "Ready", "Shutdown", "StartFailed",
           "recv", "replica_main", "send", "serve_replica"]

HEARTBEAT_S = 1.0  # the longest a busy replica stays silent (shorter with a short engine_iteration_timeout_s)


# --- front end -> replica -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    request_id: str
    prompt: Any
    params: Any
    priority: int
    arrival_time: float
    lora_request: Any = None


@dataclass(frozen=True, slots=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Call:
    """Run `function(engine, *args)` between steps (a module-level function: it travels by name)."""

    call_id: int
    function: Callable[..., Any]
    args: tuple = ()


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


# --- replica -> front end -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is up: what the front end needs to check and route requests as the engine would."""

    pid: int
    model_info: dict[str, Any]
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_blocks: int
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StartFailed:
    error: BaseException
    traceback: str


@dataclass(frozen=True, slots=True)
class Outputs:
    """One step's outputs (and the requests the engine refused, with their errors), then the stats after it."""

    outputs: list[Any]
    rejected: list[tuple[str, BaseException]]
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CallResult:
    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(slots=True)
class _Pending:
    """What a round of commands produced that the front end must hear of."""

    rejected: list[tuple[str, BaseException]] = field(default_factory=list)
    changed: bool = False  # a request was added or aborted: the stats moved


def send(conn: Connection, message: Any) -> None:
    """Pickle `message` with plain pickle (tensors as bytes) and send it."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    """The next message (EOFError once the other side is gone)."""
    return pickle.loads(conn.recv_bytes())


def picklable(error: BaseException) -> BaseException:
    """`error` itself when it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure: send the text instead
        return RuntimeError(f"{type(error).__name__}: {error}")


def replica_main(config: EngineConfig, registry: PluginRegistry, cpus: list[int], environ: dict[str, str],
                 commands: Connection, events: Connection) -> None:
    """Entry point of a replica process: take the front end's environment as it is now (a forkserver's child
    starts with the one the forkserver had), pin, then serve (`serve_replica`)."""
    from llmplug.engine.executors.worker_start import adopt_engine_environment
    from llmplug.platforms.cpu_threads import configure_cpu_threads

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the front end stops us
    adopt_engine_environment(environ)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    if "torch" not in sys.modules:  # spawned; forked from the forkserver, torch runs with the threads it loaded with
        parallel = config.parallel
        configure_cpu_threads(config.device.num_threads,
                              num_processes_sharing=parallel.tensor_parallel_size * parallel.pipeline_parallel_size)
    serve_replica(config, registry, commands, events)


def serve_replica(config: EngineConfig, registry: PluginRegistry, commands: Any, events: Any) -> None:
    """Build the engine, send Ready (or StartFailed), then serve commands until Shutdown or the front end leaves.
    `commands` and `events` are pipe ends, or anything with their poll / recv_bytes / send_bytes."""
    from llmplug.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config, registry)
    except BaseException as error:  # noqa: BLE001 - the front end raises it
        send(events, StartFailed(picklable(error), "".join(traceback.format_exception(error))))
        return
    try:
        core = engine.engine_core
        kv = core.kv_cache_manager
        send(events, Ready(os.getpid(), core.model_info, core.max_model_len, engine.eos_token_ids,
                           kv.num_blocks if kv is not None else 0, core.stats()))
        _serve(engine, commands, events, heartbeat_s(config))
    except (EOFError, BrokenPipeError):
        pass  # the front end is gone: nobody is left to answer
    finally:
        engine.shutdown()


def heartbeat_s(config: EngineConfig) -> float:
    """How often a busy replica that has nothing else to send says that it is alive (its stats): often enough
    that a quiet stretch of parallel.engine_iteration_timeout_s means a step that never ended."""
    return min(HEARTBEAT_S, config.parallel.engine_iteration_timeout_s / 4)


def _serve(engine: Any, commands: Connection, events: Connection, heartbeat: float) -> None:
    """Take commands, step, send outputs (and, while busy, the stats at least every `heartbeat` seconds); an
    exception that escapes a step ends the replica (the front end sees it end, fails its requests and starts a
    new one)."""
    last_sent = time.monotonic()
    while True:
        pending = _Pending()
        if not _apply_commands(engine, commands, events, pending, block=not engine.has_unfinished_requests()):
            return
        outputs = engine.step() if engine.has_unfinished_requests() else []
        now = time.monotonic()
        if outputs or pending.rejected or pending.changed or now - last_sent >= heartbeat:
            send(events, Outputs(outputs, pending.rejected, engine.engine_core.stats()))
            last_sent = now


def _apply_commands(engine: Any, commands: Connection, events: Connection, pending: _Pending, block: bool) -> bool:
    """Run the queued commands (waiting for the first when `block`); False once Shutdown came."""
    if not block and not commands.poll():
        return True
    while True:
        command = recv(commands)
        if isinstance(command, Shutdown):
            return False
        _apply(engine, command, events, pending)
        if not commands.poll():
            return True


def _apply(engine: Any, command: Any, events: Connection, pending: _Pending) -> None:
    if isinstance(command, AddRequest):
        pending.changed = True
        try:
            engine.add_request(command.request_id, command.prompt, command.params, priority=command.priority,
                               arrival_time=command.arrival_time, lora_request=command.lora_request)
        except Exception as error:  # noqa: BLE001 - delivered to the one request it concerns
            pending.rejected.append((command.request_id, picklable(error)))
    elif isinstance(command, AbortRequests):
        pending.changed = True
        engine.abort_request(command.request_ids)
    else:
        try:
            result = CallResult(command.call_id, value=command.function(engine, *command.args))
        except Exception as error:  # noqa: BLE001 - delivered to the caller that asked
            result = CallResult(command.call_id, error=picklable(error))
        pending.changed = True
        send(events, result)
