"""`llmplug serve --data-parallel-size 2`: one server in front of two replica processes.

Greedy completions through the real `openai` client, streamed and not, equal the offline DP=1 engine's; /health
lists the replicas and /metrics labels the engine series, and each request's series, by replica; a replica killed while the server runs is
reported, restarted, and serves again.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import requests
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmplug import AsyncLLM, SamplingParams
from tests.entrypoints.openai.conftest import ENGINE_KWARGS, serve

PROMPTS = ["The capital of France is", "One, two, three,", "Hello, my name is", "A long time ago",
           "def fibonacci(n):", "The quick brown fox"]


@pytest.fixture(scope="module")
def dp_server(tiny_chat_model):
    engine = AsyncLLM(str(tiny_chat_model), **ENGINE_KWARGS, data_parallel_size=2)
    try:
        with serve(engine) as running:
            yield running
    finally:
        engine.shutdown()


def health(server) -> requests.Response:
    return requests.get(f"{server.base_url}/health", timeout=10)


def test_greedy_completions_equal_one_engine_streamed_or_not(dp_server, offline_llm):
    client = dp_server.client()

    def complete(prompt: str) -> str:
        return client.completions.create(model=dp_server.model, prompt=prompt, max_tokens=10,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: both replicas get some
        texts = list(pool.map(complete, PROMPTS))
    stream = client.completions.create(model=dp_server.model, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                       stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream)
    expected = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0),
                                                                use_tqdm=False)]
    assert texts == expected and streamed == expected[0]
    served = [state.stats.get("prefix_cache_queries", 0) for state in dp_server.engine.replica_states()]
    assert all(queries > 0 for queries in served)
    # each request's series are those of the replica that ran it: both have some, and all 7 are counted once
    e2e, ttft = per_engine(dp_server, "vllm:e2e_request_latency_seconds_count"), \
        per_engine(dp_server, "vllm:time_to_first_token_seconds_count")
    assert set(e2e) == {"0", "1"} and all(count > 0 for count in e2e.values()) and sum(e2e.values()) == 7
    assert ttft == e2e
    generated = per_engine(dp_server, "vllm:generation_tokens_total")  # counted as tokens come, per replica too
    assert {engine for engine, count in generated.items() if count > 0} == {"0", "1"}


def per_engine(server, sample_name: str) -> dict[str, float]:
    """The value of `sample_name` in /metrics, by `engine` label."""
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    return {sample.labels["engine"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == sample_name}


def test_health_and_metrics_show_each_replica_and_a_killed_one_is_restarted(dp_server):
    replicas = health(dp_server).json()["replicas"]
    assert [(r["engine"], r["status"], r["restarts"]) for r in replicas] == [("0", "running", 0), ("1", "running", 0)]
    metrics = requests.get(f"{dp_server.base_url}/metrics", timeout=10).text
    assert 'llmplug_dp_replica_up{engine="1"} 1.0' in metrics
    assert 'vllm:num_requests_running{engine="0",model_name=' in metrics
    assert 'vllm:num_requests_running{engine="1",model_name=' in metrics

    os.kill(replicas[1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        response = health(dp_server)
        replica = response.json()["replicas"][1]
        assert response.status_code == 200  # replica 0 serves throughout
        if replica["restarts"] == 1 and replica["status"] == "running":
            break
        time.sleep(0.05)
    assert replica["restarts"] == 1 and "SIGKILL" in replica["last_error"] and replica["pid"] != replicas[1]["pid"]
    metrics = requests.get(f"{dp_server.base_url}/metrics", timeout=10).text
    assert 'llmplug_dp_replica_restarts_total{engine="1"} 1.0' in metrics
    client = dp_server.client()
    for prompt in PROMPTS[:4]:  # both replicas answer again
        assert client.completions.create(model=dp_server.model, prompt=prompt, max_tokens=3).choices[0].text
