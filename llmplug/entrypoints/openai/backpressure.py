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

        async def timed_send(message: dict[str, Any]) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout)
            except asyncio.TimeoutError:
                raise SlowReader() from None

        try:
            await self.app(scope, receive, timed_send)
        except SlowReader:  # the response is half sent: uvicorn closes the connection when the app returns
            client = scope.get("client")
            logger.warning("%s %s: the client at %s read nothing for %g s (--stream-send-timeout); its request "
                           "was aborted", scope["method"], scope["path"], client[0] if client else "?",
                           self.send_timeout)


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
