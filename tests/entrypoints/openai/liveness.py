"""A watch on the server while a costly request is served: a `/health` poll that must answer within 1 s and
a 4-token completion every 2 s that must answer within 5 s (issue 35's bar for "no request can stall it")."""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

HEALTH_LIMIT_S = 1.0
COMPLETION_LIMIT_S = 5.0


@dataclass
class Liveness:
    """The slowest answers seen while watching, and what failed."""

    health_s: list[float] = field(default_factory=list)
    completion_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Assert that every poll and completion answered in time (and that some ran)."""
        assert not self.errors, self.errors
        assert self.health_s and self.completion_s, "the watch ran no probe"
        assert max(self.health_s) < HEALTH_LIMIT_S, f"/health took {max(self.health_s):.2f} s"
        assert max(self.completion_s) < COMPLETION_LIMIT_S, f"a 4-token completion took {max(self.completion_s):.2f} s"


@contextlib.contextmanager
def watching(server, request: Callable[[], None] | None = None) -> Iterator[Liveness]:
    """Poll `/health` (every 0.2 s) and send a 4-token completion (every 2 s; on a pooling server, `request`
    instead) until the block ends, then check."""
    seen, stop = Liveness(), threading.Event()
    request = request or (lambda: _complete(server))
    threads = [threading.Thread(target=_every, args=(stop, 0.2, lambda: _health(server), seen.health_s, seen.errors)),
               threading.Thread(target=_every, args=(stop, 2.0, request, seen.completion_s, seen.errors))]
    for thread in threads:
        thread.start()
    try:
        yield seen
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    seen.check()


def _every(stop: threading.Event, period: float, probe, times: list[float], errors: list[str]) -> None:
    while not stop.is_set():
        start = time.monotonic()
        try:
            probe()
        except Exception as exc:  # noqa: BLE001 - reported by check()
            errors.append(repr(exc))
        times.append(time.monotonic() - start)
        stop.wait(max(period - (time.monotonic() - start), 0.0))


def _health(server) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/health")
        status = conn.getresponse().status
        assert status == 200, f"/health answered {status}"
    finally:
        conn.close()


def _complete(server) -> None:
    reply = server.client(timeout=30).completions.create(model=server.model, prompt="hi", max_tokens=4,
                                                         temperature=0.0)
    assert reply.choices[0].finish_reason == "length"
