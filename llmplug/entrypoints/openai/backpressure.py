"""Backpressure on slow readers: a client that does not take its response's bytes within `send_timeout`
seconds is dropped, and the request behind the response is aborted at once.

uvicorn's `send` waits while the connection's write buffer is full, that is once the client's socket
buffers and the transport's hold all they can of what the client has not read. A stream whose client
stops reading would otherwise wait there forever, holding its admission slots and KV blocks (the engine's
output queue behind it merges outputs instead of growing: `llmplug.engine.request_stream`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from llmplug.entrypoints.openai.loggable import loggable

logger = logging.getLogger(__name__)


class SlowReader(Exception):
    """The client did not read its response for longer than the send timeout."""


class SendTimeoutMiddleware:
    """Ends a response whose client leaves a write waiting longer than `send_timeout` seconds (0: never)."""

    def __init__(self, app: ASGIApp, send_timeout: float) -> None:
        self.app = app
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.send_timeout <= 0:
            await self.app(scope, receive, send)
            return
        watch = _SendWatch(self.send_timeout)

        async def timed_send(message: dict[str, Any]) -> None:
            await watch.send(send, message)

        try:
            await self.app(scope, receive, timed_send)
        except SlowReader:  # the response is half sent: uvicorn closes the connection when the app returns
            client = scope.get("client")
            logger.warning("%s %s: the client at %s read nothing for %g s (--stream-send-timeout); its request "
                           "was aborted", scope["method"], loggable(scope["path"]), client[0] if client else "?",
                           self.send_timeout)
        finally:
            watch.close()


class _SendWatch:
    """Times one response's writes with a single timer that wakes once a period, not one timer per write:
    asyncio.wait_for around every chunk cost ~50 us of the event loop, over 100x the write itself."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.since: float | None = None  # loop time the write in progress started; None: no write waits
        self.task: asyncio.Task | None = None  # the task of that write
        self.expired = False
        self.timer = self.loop.call_later(timeout, self._check)

    async def send(self, send: Send, message: dict[str, Any]) -> None:
        """`send(message)`; SlowReader when it waits longer than the timeout."""
        self.since, self.task = self.loop.time(), asyncio.current_task()
        try:
            await send(message)
        except asyncio.CancelledError:
            if not self.expired:
                raise
            uncancel = getattr(self.task, "uncancel", None)  # Python 3.11+: the cancellation was ours, now handled
            if uncancel is not None:
                uncancel()
            raise SlowReader() from None
        finally:
            self.since = None

    def _check(self) -> None:
        since = self.since
        if since is not None and self.loop.time() - since >= self.timeout:
            self.expired = True
            self.task.cancel()  # the task waits in `send` (since is set): the cancellation lands there
            return
        delay = self.timeout if since is None else since + self.timeout - self.loop.time()
        self.timer = self.loop.call_later(delay, self._check)

    def close(self) -> None:
        self.timer.cancel()


class EventStreamResponse(StreamingResponse):
    """A server-sent event stream that closes its event generator as soon as the response ends, however it
    ends (done, client gone, slow reader): closing it aborts the request behind it and frees its admission
    slots and KV blocks now, not when the garbage collector gets to the generator."""

    def __init__(self, content: Any, headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # also when the stream was cancelled (the client left)
                await self.body_iterator.aclose()
