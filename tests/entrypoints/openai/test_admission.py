"""Admission control: past the cap on waiting requests the server answers 503 with Retry-After (and recovers);
preemptions are a Prometheus counter."""

from __future__ import annotations

import asyncio
import http.client
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmplug import AsyncLLM
from llmplug.core.errors import ConfigError
from llmplug.entrypoints.cli import build_parser
from llmplug.entrypoints.openai.admission import AdmissionControl
from llmplug.entrypoints.openai.api_server import ServerSettings

from .conftest import ENGINE_KWARGS, is_idle, serve
from .test_streaming import metrics

LONG = {"temperature": 0, "max_tokens": 150, "stream": True, "extra_body": {"ignore_eos": True}}


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def one_seq_engine(tiny_chat_model):
    """An engine that runs one sequence at a time: every other request waits."""
    engine = AsyncLLM(str(tiny_chat_model), max_num_seqs=1, **ENGINE_KWARGS)
    yield engine
    engine.shutdown()


def test_past_the_waiting_cap_the_server_answers_503_with_retry_after(one_seq_engine):
    with serve(one_seq_engine, ServerSettings(max_waiting_requests=2)) as running:

        async def scenario() -> None:
            client = running.async_client(timeout=120)
            prompt = {"model": running.model, "prompt": "Count:"}
            first = await client.completions.create(**prompt, **LONG)
            await anext(first)  # in the running batch now
            waiting = [asyncio.ensure_future(client.completions.create(**prompt, **LONG)) for _ in range(2)]
            await asyncio.to_thread(wait_for, lambda: one_seq_engine.stats()["num_waiting"] == 2)
            with pytest.raises(openai.InternalServerError) as info:
                await client.completions.create(**prompt, max_tokens=2)
            response = info.value.response
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "server_overloaded"
            await first.close()  # a place frees up: the waiting requests run, and new ones are admitted
            for task in waiting:
                stream = await task
                assert len([chunk async for chunk in stream]) > 1
            reply = await client.completions.create(**prompt, temperature=0, max_tokens=2)
            assert reply.choices[0].finish_reason == "length"
            await client.close()

        asyncio.run(scenario())
        assert metrics(running)["llmplug_http_responses_total{endpoint=/v1/completions,status=503}"] == 1
        wait_for(lambda: is_idle(one_seq_engine))


def test_preemptions_are_a_prometheus_counter(tiny_chat_model):
    engine = AsyncLLM(str(tiny_chat_model), num_gpu_blocks_override=12, max_num_seqs=6, **ENGINE_KWARGS)
    try:
        with serve(engine) as running:

            async def crowd() -> None:
                client = running.async_client(timeout=120)
                await asyncio.gather(*(client.completions.create(
                    model=running.model, prompt=f"Client {i} counts:", temperature=0, max_tokens=40,
                    extra_body={"ignore_eos": True}) for i in range(6)))
                await client.close()

            asyncio.run(crowd())
            running.wait_idle()
            exposition = _metrics_text(running)
        [family] = [f for f in text_string_to_metric_families(exposition) if f.name == "llmplug_num_preemptions"]
        assert family.type == "counter"
        [sample] = family.samples
        assert sample.name == "llmplug_num_preemptions_total"
        assert sample.value == engine.stats()["num_preemptions"] > 0
    finally:
        engine.shutdown()


def _metrics_text(server) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_a_waiting_cap_below_one_is_refused():
    with pytest.raises(ConfigError, match="max_waiting_requests=0: must be at least 1"):
        AdmissionControl(0, lambda: 0)
    parser, _ = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-waiting-requests", "0"])
