"""Run a function in N spawned processes that meet as torch.distributed ranks on 127.0.0.1 (gloo).

Each process gets the variables a launcher like torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) and one torch thread; its return value comes back through a queue.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import traceback
from typing import Any, Callable

from llmplug.engine.executors.base import free_local_port


def _child(fn: Callable[[], Any], env: dict[str, str], results: Any) -> None:
    os.environ.update(env)
    rank = int(env["RANK"])
    try:
        # pickled here, by value: the queue's own pickler would share a tensor's storage through a file descriptor
        # that this process serves until it exits, which it may do before the parent asks for it
        results.put((rank, True, pickle.dumps(fn())))
    except BaseException:  # the parent reports it
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[[], Any], world_size: int, procs_per_node: int | None = None, timeout: float = 120) -> list:
    """`fn()` in `world_size` processes (`procs_per_node` per simulated node: LOCAL_RANK restarts on each);
    returns the results in rank order, or raises with the first failing rank's traceback."""
    per_node = procs_per_node or world_size
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = str(free_local_port())
    saved = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # read by torch when the child imports it
    procs = []
    try:
        for rank in range(world_size):
            env = dict(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % per_node),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            proc = context.Process(target=_child, args=(fn, env, results), daemon=True)
            proc.start()
            procs.append(proc)
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    try:
        collected = dict(_collect(results, world_size, timeout))
    finally:
        join_or_kill(procs)
    return [collected[rank] for rank in range(world_size)]


def join_or_kill(procs: list, timeout: float = 10) -> None:
    """Wait for each process to end; kill the ones still running after `timeout` seconds."""
    for proc in procs:
        proc.join(timeout=timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()


def _collect(results: Any, world_size: int, timeout: float):
    for _ in range(world_size):
        try:
            rank, ok, value = results.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"not every rank answered within {timeout} s") from None
        if not ok:
            raise AssertionError(f"rank {rank} failed:\n{value}")
        yield rank, pickle.loads(value)
