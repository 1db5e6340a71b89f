"""What guards the server: the Host allow-list, API keys, per-client rate limits and a request body size limit
(ASGI middleware).

- A request whose Host header names no allowed host gets 400 before anything else runs. On by default
  for a loopback bind (localhost, 127.0.0.1, ::1): a web page whose DNS name is rebound to 127.0.0.1
  reaches a loopback server from the visitor's browser, but its requests carry the page's own name, so a
  keyless local server is not open to every site its user visits.

- Every route but `OPEN_PATHS` needs `Authorization: Bearer <key>` when API keys are configured: the
  policy is opt-out by that explicit list, so a route added later is guarded too. Keys are compared in
  constant time (hmac.compare_digest) and a wrong key gets 401.
- The rate limit is a token bucket per client: per API key when keys are configured, else per client
  address. Over the limit: 429 with `Retry-After` (whole seconds until the next request is allowed).
- A body over the size limit gets 413 before the app reads it; the body is read here, bounded, and
  replayed to the app.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import re
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from llmplug.core.errors import ConfigError
from llmplug.entrypoints.openai.errors import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The only routes served without the API key and the rate limit: load balancers and Prometheus call them.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})

_PERIODS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0, "h": 3600.0,
            "hour": 3600.0}


@dataclass(frozen=True, slots=True)
class RateLimit:
    """`requests` per `period` seconds, with bursts of up to `requests`."""

    requests: float
    period: float

    @classmethod
    def parse(cls, text: str) -> "RateLimit":
        """'10/s', '600/min', '5000/h' (also '10/second', '2.5/s')."""
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*/\s*([a-z]+)\s*", text.lower())
        if not match or match.group(2) not in _PERIODS or float(match.group(1)) <= 0:
            raise ConfigError(f"--rate-limit {text!r}: expected N/s, N/min or N/h with N > 0, e.g. '10/s'")
        return cls(float(match.group(1)), _PERIODS[match.group(2)])

    @property
    def per_second(self) -> float:
        """Sustained requests per second."""
        return self.requests / self.period


class TokenBuckets:
    """One token bucket per client key; thread-safe."""

    MAX_CLIENTS = 10_000  # beyond this, full (idle) buckets are dropped

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill time)
        self._lock = threading.Lock()

    def acquire(self, key: str) -> float:
        """Take one token for `key`: 0.0 when allowed, else the seconds until one is available."""
        with self._lock:
            now = self.clock()
            tokens, last = self._buckets.get(key, (self.limit.requests, now))
            tokens = min(self.limit.requests, tokens + (now - last) * self.limit.per_second)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                self._prune(now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.limit.per_second

    def _prune(self, now: float) -> None:
        if len(self._buckets) <= self.MAX_CLIENTS:
            return
        full_after = self.limit.period  # an untouched bucket is full again after one period
        self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < full_after}


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _bearer_token(scope: Scope) -> str | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


async def _send_error(send: Send, status: int, message: str, code: str | None = None,
                      headers: dict[str, str] | None = None, scope: Scope | None = None) -> None:
    response = JSONResponse(error_body(status, message, None, code), status_code=status, headers=headers)
    await response(scope or {}, _no_receive, send)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


class AccessMiddleware:
    """API-key check and rate limit of every route but OPEN_PATHS (and CORS preflights, which carry no key)."""

    def __init__(self, app: ASGIApp, api_keys: list[str], rate_limit: RateLimit | None):
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self.buckets = TokenBuckets(rate_limit) if rate_limit else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope)
        if self.api_keys and not self._valid(token):
            await _send_error(send, 401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                              "invalid_api_key", {"WWW-Authenticate": "Bearer"}, scope)
            return
        if self.buckets is not None:
            wait = self.buckets.acquire(self._client_key(scope, token))
            if wait > 0:
                retry_after = str(max(1, math.ceil(wait)))
                await _send_error(send, 429, f"Rate limit reached ({self._limit_text()}); retry in {retry_after} s.",
                                  "rate_limit_exceeded", {"Retry-After": retry_after}, scope)
                return
        await self.app(scope, receive, send)

    def _valid(self, token: str | None) -> bool:
        if token is None:
            return False
        given = token.encode()
        # compare with every key (no early exit), so timing tells nothing about which key was close
        return any([hmac.compare_digest(given, key) for key in self.api_keys])

    def _client_key(self, scope: Scope, token: str | None) -> str:
        """Per API key when keys guard the server (a hash, so keys never sit in memory twice), else per address."""
        if self.api_keys and token is not None:
            return "key:" + hashlib.sha256(token.encode()).hexdigest()
        client = scope.get("client")
        return f"addr:{client[0] if client else 'unknown'}"

    def _limit_text(self) -> str:
        limit = self.buckets.limit
        unit = {1.0: "s", 60.0: "min", 3600.0: "h"}.get(limit.period, f"{limit.period:g} s")
        return f"{limit.requests:g}/{unit} per client"


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind_host: str) -> list[str]:
    """The Host names a server listening on `bind_host` accepts by default: the loopback names for a loopback
    bind, any ("*") otherwise (a server on a public address is reached under names only its operator knows)."""
    return list(LOOPBACK_HOSTS) if _is_loopback(bind_host) else ["*"]


def _is_loopback(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host of a Host header, without its port: 'Example.com:80' -> 'example.com', '[::1]:8000' -> '::1'."""
    value = header.strip().lower()
    if value.startswith("["):  # an IPv6 literal, whose colons are not the port's
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:  # name:port (a bare IPv6 literal has more colons)
        value = value.partition(":")[0]
    return value.rstrip(".")


class HostCheckMiddleware:
    """Answers 400 to a request whose Host header is not in `allowed_hosts` ("*": any host)."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]):
        self.app = app
        self.any = "*" in allowed_hosts
        self.allowed = frozenset(host_name(h) for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.any or host_name(_header(scope, b"host") or "") in self.allowed:
            await self.app(scope, receive, send)
            return
        # the client's Host is not echoed: it is the client's text
        await _send_error(send, 400, "The Host header names a host this server does not serve (see "
                                     "--allowed-hosts).", "invalid_host", scope=scope)


class BodySizeLimitMiddleware:
    """Answers 413 to a request body over `max_bytes`; reads the body (bounded) and replays it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send, scope)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, scope)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, send: Send, scope: Scope) -> None:
        await _send_error(send, 413, f"The request body is larger than the server's limit of {self.max_bytes} bytes.",
                          "request_too_large", {"Connection": "close"}, scope)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then the connection's own messages (disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
