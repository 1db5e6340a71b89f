"""Many concurrent streaming clients, and clients that leave early (their requests are aborted)."""

from __future__ import annotations

import asyncio
import http.client
import time

import openai
from prometheus_client.parser import text_string_to_metric_families

from llmplug import SamplingParams

NUM_CLIENTS = 64
MAX_TOKENS = 12


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics as 'name{label=value,...}' -> value."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Client {i} asks: what is {i} times {i + 3}?"}]


async def stream_one(client: openai.AsyncOpenAI, model: str, i: int) -> dict:
    stream = await client.chat.completions.create(
        model=model, messages=conversation(i), temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    return {"chunks": chunks, "text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)}


def assert_well_formed(chunks: list) -> None:
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and chunks[-2].choices[0].finish_reason == finishes[0]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_concurrent_streaming_clients_match_offline_and_free_every_block(server, offline):
    conversations = [conversation(i) for i in range(NUM_CLIENTS)]
    expected = offline.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)

    async def run_all() -> list[dict]:
        client = server.async_client(timeout=120)
        try:
            return await asyncio.gather(*(stream_one(client, server.model, i) for i in range(NUM_CLIENTS)))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    for result, want in zip(results, expected):
        assert_well_formed(result["chunks"])
        assert result["text"] == want.outputs[0].text
        assert result["chunks"][-1].usage.completion_tokens == len(want.outputs[0].token_ids)
    server.wait_idle()
    kv = server.engine.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert metrics(server)["llmplug_kv_cache_usage_perc"] == 0.0


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_disconnect_mid_stream_aborts_the_request(server):
    server.wait_idle()
    aborted = metrics(server)['llmplug_requests_total{outcome=abort}']
    stream = server.client().chat.completions.create(
        model=server.model, messages=conversation(1), temperature=0, max_tokens=200, stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert server.engine.stats()["num_running"] == 1
    stream.close()
    wait_for(lambda: metrics(server)['llmplug_requests_total{outcome=abort}'] == aborted + 1)
    server.wait_idle()
    assert metrics(server)["llmplug_num_requests_running"] == 0


def test_client_timeout_on_a_non_streamed_request_aborts_it(default_server):
    # the real default model: the tiny one now writes its 250 tokens (its context's limit) within the 0.3 s timeout
    server = default_server
    server.wait_idle()
    aborted = metrics(server)['llmplug_requests_total{outcome=abort}']
    impatient = server.client(timeout=0.3)
    try:
        impatient.completions.create(model=server.model, prompt="hi", temperature=0, max_tokens=250,
                                     extra_body={"ignore_eos": True})
    except openai.APITimeoutError:
        pass
    else:
        raise AssertionError("the request finished before the client gave up; make it longer")
    wait_for(lambda: metrics(server)['llmplug_requests_total{outcome=abort}'] == aborted + 1)
    server.wait_idle()


def test_metrics_count_tokens_and_latencies(server):
    before = metrics(server)
    server.client().completions.create(model=server.model, prompt="hello", temperature=0, max_tokens=5,
                                       extra_body={"ignore_eos": True})
    after = metrics(server)
    assert after["llmplug_generation_tokens_total"] - before["llmplug_generation_tokens_total"] == 5
    assert after["llmplug_prompt_tokens_total"] > before["llmplug_prompt_tokens_total"]
    assert after["llmplug_requests_total{outcome=length}"] == before["llmplug_requests_total{outcome=length}"] + 1
    for name in ("llmplug_time_to_first_token_seconds", "llmplug_time_per_output_token_seconds",
                 "llmplug_e2e_request_latency_seconds"):
        assert after[f"{name}_count"] == before[f"{name}_count"] + 1
    for gauge in ("llmplug_num_requests_running", "llmplug_num_requests_waiting", "llmplug_prefix_cache_hit_rate"):
        assert gauge in after
    assert after["llmplug_http_responses_total{endpoint=/v1/completions,status=200}"] >= 1
