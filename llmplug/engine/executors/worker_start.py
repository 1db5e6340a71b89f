"""How the multiproc executor starts worker processes: forked from a forkserver that imported the worker stack once.

A spawned worker is a fresh interpreter that imports torch, transformers and the engine (~3 s of CPU each here)
before it loads its model, so a TP=2 engine of a tiny model took ~5 s to start. The forkserver (one per engine
process, started with the first multiproc engine) imports them once (`worker_preload`); each worker is then a fork
of it, ready in a fraction of a second, and every later engine of the process (tests, RL loops re-creating engines)
starts in ~1 s. The fork happens before any thread or device context exists, so it is as safe as spawn; like spawn,
each worker imports the user's main module again (main_guard.py still applies).

`VLLM_WORKER_MULTIPROC_METHOD=spawn` (vLLM's variable) starts fresh interpreters instead; `fork` (a fork of the
engine process itself, with its threads) is refused.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import BaseContext

from llmplug.core.errors import ConfigError

__all__ = ["START_METHOD_ENV", "adopt_engine_environment", "worker_context"]

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
START_METHODS = ("forkserver", "spawn")
PRELOAD = "llmplug.engine.executors.worker_preload"
# read by OpenMP when torch loaded in the forkserver: a worker keeps the values its runtime runs with
_LOADED_WITH = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def worker_context(world_size: int) -> BaseContext:
    """The multiprocessing context the workers of one engine start from."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in START_METHODS:
        raise ConfigError(f"{START_METHOD_ENV}={method!r}: the multiproc executor starts workers by "
                          f"{' or '.join(START_METHODS)} (a fork of the engine process would copy its threads)")
    if method == "forkserver" and world_size == 1:
        method = "spawn"  # one worker owns the cores (ACTIVE wait policy), which the forkserver's torch cannot take
    if method == "forkserver":
        multiprocessing.set_forkserver_preload([PRELOAD])  # takes effect when the forkserver starts (once)
    return multiprocessing.get_context(method)


def adopt_engine_environment(environ: dict[str, str]) -> None:
    """Give a worker the engine's environment as it is now: a forkserver's children start with the one it had when it
    started. The OpenMP variables torch loaded with in this process stay (they can no longer change)."""
    loaded = {name: os.environ[name] for name in _LOADED_WITH if name in os.environ}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(loaded)
