"""An engine that dies (a fatal error) fails its in-flight streams with an error, and the server reports unhealthy."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import openai
import pytest
import torch

from llmplug import AsyncLLM, SamplingParams
from llmplug.core.errors import EngineDeadError

from tests.engine.faults import break_forward

from .conftest import ENGINE_KWARGS, serve


def crash(engine: AsyncLLM) -> None:
    """Break the engine for good: the device fails inside a step (the error a lost CUDA context raises)."""
    break_forward(engine, "device lost", error=torch.AcceleratorError)

    async def run() -> None:
        params = SamplingParams(max_tokens=4)
        async for _ in engine.generate({"prompt_token_ids": [1, 2, 3]}, params, "crasher"):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(run())


def get(server, path: str) -> tuple[int, dict | None]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", path)
    response = conn.getresponse()
    body = response.read()
    conn.close()
    return response.status, json.loads(body) if body else None


def test_engine_death_fails_streams_and_health(tiny_chat_model):
    engine = AsyncLLM(str(tiny_chat_model), **ENGINE_KWARGS)
    try:
        with serve(engine) as server:
            assert get(server, "/health")[0] == 200
            started, outcome = threading.Event(), {}

            def long_stream() -> None:
                stream = server.client(timeout=60).completions.create(
                    model=server.model, prompt="hi", max_tokens=200, stream=True, extra_body={"ignore_eos": True})
                try:
                    for _ in stream:
                        started.set()
                except openai.APIError as exc:
                    outcome["error"] = str(exc)
                else:
                    outcome["error"] = None

            thread = threading.Thread(target=long_stream)
            thread.start()
            assert started.wait(30)
            crash(engine)
            thread.join(30)
            assert outcome["error"] and "engine failed" in outcome["error"]

            status, body = get(server, "/health")
            assert status == 503 and body["error"]["code"] == "engine_dead"
            with pytest.raises(openai.InternalServerError) as info:
                server.client().chat.completions.create(model=server.model,
                                                        messages=[{"role": "user", "content": "hi"}])
            assert info.value.status_code == 503
            assert get(server, "/version")[0] == 200  # the server itself still answers
    finally:
        engine.shutdown()
