"""`llmplug proxy`: disaggregated prefill and decode behind one OpenAI-compatible address.

Two `llmplug serve` engines share a `disk_offload` KV directory (docs/kv_offload.md): the prefill engine runs with
`kv_role: kv_producer`, the decode engine with `kv_role: kv_consumer`. For each completion or chat request the proxy
first sends the prefill engine the same body with one token to generate and no streaming, which computes the
prompt's KV blocks and writes them (the producer writes each block before its step returns); then it sends the
client's own body to the decode engine, which loads those blocks instead of computing them, and relays its answer
(streamed when asked). A prefill engine's refusal (a bad body, a missing model) is returned as it is, and nothing
reaches the decode engine. Other routes (`/v1/models`, `/tokenize`, ...) go to the decode engine.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

__all__ = ["build_proxy_app", "prefill_body"]

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
# request headers passed on to the engines (the client's key, its request id)
FORWARDED_HEADERS = ("authorization", "x-request-id", "content-type")
# the fields of a body that make the prefill call one short, whole answer
PREFILL_OVERRIDES: dict[str, Any] = {"max_tokens": 1, "stream": False, "n": 1}
PREFILL_DROPPED = ("stream_options", "max_completion_tokens", "best_of", "use_beam_search")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as the prefill engine gets it: the same prompt and settings, one token, no stream."""
    kept = {key: value for key, value in body.items() if key not in PREFILL_DROPPED}
    return kept | PREFILL_OVERRIDES


def build_proxy_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    """The proxy's app: generation routes through both engines, everything else to the decode engine."""
    engines = {"prefill": prefill_url.rstrip("/"), "decode": decode_url.rstrip("/")}
    sessions: dict[str, aiohttp.ClientSession] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10)) as session:
            sessions["http"] = session
            yield

    app = FastAPI(title="llmplug disaggregated prefill/decode proxy", lifespan=lifespan)

    @app.get("/health")
    async def health() -> Response:
        for name, url in engines.items():
            try:
                async with sessions["http"].get(f"{url}/health") as reply:
                    status = reply.status
            except aiohttp.ClientError as error:
                return JSONResponse({"error": f"{name} engine unreachable: {error}"}, status_code=503)
            if status != 200:
                return JSONResponse({"error": f"{name} engine unhealthy ({status})"}, status_code=503)
        return Response(status_code=200)

    async def generate(request: Request) -> Response:
        headers = _forwarded(request)
        try:
            body = await request.json()
        except ValueError:
            return _bad_request("the body is not JSON")
        if not isinstance(body, dict):
            return _bad_request("the body must be a JSON object")
        path = request.url.path
        async with sessions["http"].post(engines["prefill"] + path, json=prefill_body(body), headers=headers) as reply:
            if reply.status != 200:
                return await _relay(reply)
            await reply.read()
        if body.get("stream"):
            return await _stream(sessions["http"], engines["decode"] + path, body, headers)
        async with sessions["http"].post(engines["decode"] + path, json=body, headers=headers) as reply:
            return await _relay(reply)

    for route in GENERATION_ROUTES:
        app.add_api_route(route, generate, methods=["POST"])

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def to_decode(path: str, request: Request) -> Response:
        async with sessions["http"].request(request.method, f"{engines['decode']}/{path}", data=await request.body(),
                                            headers=_forwarded(request), params=request.query_params) as reply:
            return await _relay(reply)

    return app


def _forwarded(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "code": 400}}, status_code=400)


async def _relay(reply: aiohttp.ClientResponse) -> Response:
    return Response(await reply.read(), status_code=reply.status,
                    media_type=reply.headers.get("content-type", "application/json"))


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
    """The decode engine's server-sent events, relayed as they come (its error status as it is)."""
    reply = await session.post(url, json=body, headers=headers)
    if reply.status != 200:
        try:
            return await _relay(reply)
        finally:
            reply.release()

    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in reply.content.iter_any():
                yield chunk
        finally:
            reply.release()

    return StreamingResponse(events(), media_type=reply.headers.get("content-type", "text/event-stream"))
