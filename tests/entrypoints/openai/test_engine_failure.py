"""An engine that dies (a fatal error) fails its in-flight streams with an error, and the server reports unhealthy."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import openai
import pytest
import torch

from llmplug import AsyncLLM, SamplingParams
from llmplug.core.errors import EngineDeadError

from llmplug.entrypoints.openai.api_server import ServerSettings
from tests.engine.faults import block_forward, break_forward

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


def timed_get(server, path: str) -> tuple[int, dict | None]:
    """`get`, checking that the answer took less than a second (a load balancer's check must not hang)."""
    start = time.monotonic()
    answer = get(server, path)
    assert time.monotonic() - start < 1.0, f"{path} took {time.monotonic() - start:.2f} s"
    return answer


def test_a_stalled_engine_fails_health_until_it_steps_again(engine):
    """A step that does not end (a hung kernel) is a 503 on /health once it has run past the threshold, though
    the engine thread is alive; the engine idle for longer than the threshold is healthy."""
    release, reply = threading.Event(), {}
    with serve(engine, ServerSettings(health_stall_timeout=0.5)) as server:
        try:
            time.sleep(0.6)
            assert timed_get(server, "/health")[0] == 200  # idle is not stalled
            block_forward(engine, release)
            client = server.client(timeout=60)
            waiter = threading.Thread(target=lambda: reply.update(answer=client.completions.create(
                model=server.model, prompt="hi", max_tokens=4)))
            waiter.start()
            deadline = time.monotonic() + 20
            while (answer := timed_get(server, "/health"))[0] == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            status, body = answer
            assert status == 503 and body["error"]["code"] == "engine_stalled", answer
            assert "stalled" in body["error"]["message"] and not reply
        finally:
            release.set()
        waiter.join(30)
        assert reply["answer"].choices[0].finish_reason == "length"  # the stalled request itself completes
        assert timed_get(server, "/health")[0] == 200
        again = server.client().completions.create(model=server.model, prompt="hi", max_tokens=4)
        assert again.choices[0].finish_reason == "length"
