"""Run a function of a client's constraint in a separate process, under a time budget.

Some guided-decoding backends build a constraint's whole automaton before generating, and its size can
grow exponentially with the regex (see `llmplug.plugins.guided_decoding.automata`). A thread cannot be
stopped, and pure-Python work in one takes the GIL from the engine's threads; a process can be killed. So
the engine measures such an automaton here first: a measure past its budget is killed with its process (a
400 for that request), and one in time says how large the compile in the engine process will be.

Workers are fresh interpreters (`python -m llmplug.engine.grammar_sandbox`, not forks of the engine's
threads), started on first use, shared by the process's engines and reused until one is killed. The
function is pickled by reference, so it must be a module-level function of a light module: importing it is
not timed, but the worker imports it once per kind.
"""

from __future__ import annotations

import atexit
import os
import pickle
import resource
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

__all__ = ["SandboxTimeout", "SandboxCrash", "run_sandboxed"]

START_TIMEOUT_S = 120.0  # a worker's start and imports (not the budget: a loaded machine takes seconds)
MEMORY_LIMIT_BYTES = 4 << 30  # address space of a worker: an automaton that outgrows it ends the worker


class SandboxTimeout(Exception):
    """The function ran past its budget; its worker was killed."""


class SandboxCrash(Exception):
    """The worker died while running the function (out of memory, a library's abort)."""


class _Worker:
    """One sandbox process and the two pipes to it."""

    def __init__(self) -> None:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(to_child), str(from_child)],
            pass_fds=(to_child, from_child), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(from_child)
        self._requests = Connection(from_parent, readable=False)
        self._replies = Connection(to_parent, writable=False)
        self._requests.send_bytes(pickle.dumps(sys.path))  # the parent's imports resolve the same there

    def run(self, function: Callable[[Any], Any], argument: Any, timeout_s: float) -> Any:
        """`function(argument)` in the worker; its exception is re-raised here."""
        self._requests.send_bytes(pickle.dumps((function, argument)))
        self._receive(START_TIMEOUT_S)  # imported and started: the budget starts now
        ok, value = self._receive(timeout_s)
        if not ok:
            raise value
        return value

    def _receive(self, timeout_s: float) -> Any:
        if not self._replies.poll(timeout_s):
            self.close()
            raise SandboxTimeout(f"no answer within {timeout_s} s")
        try:
            return pickle.loads(self._replies.recv_bytes())
        except EOFError:
            self.close()
            raise SandboxCrash(f"the sandbox process ended with status {self.process.poll()}") from None

    def close(self) -> None:
        """Kill the process (it may be in the middle of a runaway build) and wait for it."""
        self.process.kill()
        self.process.wait()
        self._requests.close()
        self._replies.close()


class _Pool:
    """Idle workers, handed out one per call; a call on a busy pool starts another."""

    def __init__(self, max_idle: int = 2) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._max_idle = max_idle
        atexit.register(self.close)

    def run(self, function: Callable[[Any], Any], argument: Any, timeout_s: float) -> Any:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        worker = worker or _Worker()
        try:
            result = worker.run(function, argument, timeout_s)
        except (SandboxTimeout, SandboxCrash):
            raise  # the worker is gone
        except BaseException:
            self._keep(worker)  # the function raised: the worker is fine
            raise
        self._keep(worker)
        return result

    def _keep(self, worker: _Worker) -> None:
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(worker)
                return
        worker.close()

    def close(self) -> None:
        """Stop every idle worker."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


_POOL = _Pool()


def run_sandboxed(function: Callable[[Any], Any], argument: Any, timeout_s: float) -> Any:
    """`function(argument)` in a sandbox process: its result, or its exception; SandboxTimeout past
    `timeout_s` seconds of running (imports not counted), SandboxCrash when the process died."""
    return _POOL.run(function, argument, timeout_s)


def _serve(requests: Connection, replies: Connection) -> None:
    """The worker's loop: run each pickled call and send back (True, result) or (False, exception)."""
    sys.path[:] = pickle.loads(requests.recv_bytes())
    while True:
        try:
            message = requests.recv_bytes()
        except EOFError:  # the parent closed the pipe or died
            return
        try:
            function, argument = pickle.loads(message)
        except Exception as exc:  # noqa: BLE001 - an import that fails is the caller's error, sent back
            replies.send_bytes(pickle.dumps(True))
            replies.send_bytes(_pickled_error(exc))
            continue
        replies.send_bytes(pickle.dumps(True))
        try:
            reply = pickle.dumps((True, function(argument)))
        except Exception as exc:  # noqa: BLE001 - the function's error is the caller's, sent back
            reply = _pickled_error(exc)
        replies.send_bytes(reply)


def _pickled_error(exc: Exception) -> bytes:
    try:
        return pickle.dumps((False, exc))
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        return pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")))


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
