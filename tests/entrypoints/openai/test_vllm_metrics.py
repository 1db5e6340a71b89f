"""/metrics under vLLM's v1 names: every metric of vLLM's PrometheusStatLogger that llmplug measures is there,
with vLLM's type and labels, and after a few requests the counters and histograms say what the responses' usage
says."""

from __future__ import annotations

import http.client
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmplug import AsyncLLM
from llmplug.entrypoints.openai.metrics import ServerMetrics
from llmplug.engine.step_histogram import ITERATION_TOKENS_BUCKETS, StepHistogram
from llmplug.entrypoints.openai.vllm_metrics import build_1_2_5_buckets

from .conftest import ENGINE_KWARGS, serve

BASE = ("model_name", "engine")

# vLLM's v1 metrics that llmplug exports by default: name -> (type, labels); docs/observability.md lists them.
EXPECTED = {
    "vllm:num_requests_running": ("gauge", BASE),
    "vllm:num_requests_waiting": ("gauge", BASE),
    "vllm:kv_cache_usage_perc": ("gauge", BASE),
    "vllm:gpu_cache_usage_perc": ("gauge", BASE),
    "vllm:prefix_cache_queries": ("counter", BASE),
    "vllm:prefix_cache_hits": ("counter", BASE),
    "vllm:gpu_prefix_cache_queries": ("counter", BASE),
    "vllm:gpu_prefix_cache_hits": ("counter", BASE),
    "vllm:num_preemptions": ("counter", BASE),
    "vllm:corrupted_requests": ("counter", BASE),
    "vllm:num_requests_waiting_by_reason": ("gauge", (*BASE, "reason")),
    "vllm:iteration_tokens_total": ("histogram", BASE),
    "vllm:prompt_tokens": ("counter", BASE),
    "vllm:generation_tokens": ("counter", BASE),
    "vllm:request_success": ("counter", (*BASE, "finished_reason")),
    "vllm:request_prompt_tokens": ("histogram", BASE),
    "vllm:request_generation_tokens": ("histogram", BASE),
    "vllm:request_max_num_generation_tokens": ("histogram", BASE),
    "vllm:request_params_n": ("histogram", BASE),
    "vllm:request_params_max_tokens": ("histogram", BASE),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", BASE),
    "vllm:time_to_first_token_seconds": ("histogram", BASE),
    "vllm:inter_token_latency_seconds": ("histogram", BASE),
    "vllm:time_per_output_token_seconds": ("histogram", BASE),
    "vllm:request_time_per_output_token_seconds": ("histogram", BASE),
    "vllm:e2e_request_latency_seconds": ("histogram", BASE),
    "vllm:request_queue_time_seconds": ("histogram", BASE),
    "vllm:request_inference_time_seconds": ("histogram", BASE),
    "vllm:request_prefill_time_seconds": ("histogram", BASE),
    "vllm:request_decode_time_seconds": ("histogram", BASE),
    "vllm:cache_config_info": ("gauge", ("block_size", "gpu_memory_utilization", "enable_prefix_caching",
                                         "num_gpu_blocks_override", "num_gpu_blocks", "engine")),
}


def scrape(server) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def families(server) -> dict:
    return {f.name: f for f in text_string_to_metric_families(scrape(server))}


def value(fams: dict, name: str, suffix: str = "", **labels: str) -> float:
    """The one sample `name + suffix` of family `name` whose labels include `labels`."""
    found = [s.value for s in fams[name].samples
             if s.name == name + suffix and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{name}{suffix} {labels}: {found}"
    return found[0]


def test_every_vllm_v1_metric_is_exported_with_vllms_type_and_labels(server):
    fams = families(server)
    missing = sorted(set(EXPECTED) - set(fams))
    assert not missing, f"not exported: {missing}"
    for name, (kind, labels) in EXPECTED.items():
        family = fams[name]
        assert family.type == kind, name
        assert family.samples, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(labels), (name, sample)
            if "model_name" in labels:
                assert sample.labels["model_name"] == server.model and sample.labels["engine"] == "0"
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == str(ENGINE_KWARGS["block_size"])


def test_histograms_use_vllms_buckets(server):
    fams = families(server)

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in fams[name].samples if s.name == name + "_bucket"][:-1]  # no +Inf

    assert bounds("vllm:request_prompt_tokens") == build_1_2_5_buckets(ENGINE_KWARGS["max_model_len"])
    assert bounds("vllm:request_params_n") == [1, 2, 5, 10, 20]
    assert bounds("vllm:time_to_first_token_seconds")[:3] == [0.001, 0.005, 0.01]
    assert len(bounds("vllm:time_to_first_token_seconds")) == 22
    assert len(bounds("vllm:inter_token_latency_seconds")) == 19
    assert len(bounds("vllm:e2e_request_latency_seconds")) == 21


COUNTED = ("vllm:prompt_tokens", "vllm:generation_tokens")
PER_REQUEST = ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens",
               "vllm:request_params_n", "vllm:request_max_num_generation_tokens",
               "vllm:request_prefill_kv_computed_tokens", "vllm:e2e_request_latency_seconds",
               "vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
               "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
               "vllm:request_inference_time_seconds")  # one observation per request
HISTOGRAMS = (*PER_REQUEST, "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
              "vllm:request_time_per_output_token_seconds")


def snapshot(server) -> dict[str, float]:
    fams = families(server)
    snap = {name: value(fams, name, "_total") for name in COUNTED}
    for reason in ("stop", "length", "abort"):
        snap[reason] = value(fams, "vllm:request_success", "_total", finished_reason=reason)
    for name in HISTOGRAMS:
        snap[name + "_count"] = value(fams, name, "_count")
        snap[name + "_sum"] = value(fams, name, "_sum")
    return snap


def test_counters_and_histograms_equal_the_responses_usage(server):
    client = server.client()
    eos = server.engine.get_tokenizer().eos_token_id
    server.wait_idle()
    before = snapshot(server)
    max_tokens = [5, 7, 9]
    usages = []
    for i, limit in enumerate(max_tokens[:2]):  # both end at max_tokens
        answer = client.completions.create(model=server.model, prompt=f"Metrics request {i}: count to ten",
                                           max_tokens=limit, temperature=0.0, extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length"
        usages.append(answer.usage)
    stopped = client.chat.completions.create(  # the end token forced first: finish reason "stop"
        model=server.model, messages=[{"role": "user", "content": "stop at once"}], max_tokens=max_tokens[2],
        logit_bias={str(eos): 100})
    assert stopped.choices[0].finish_reason == "stop"
    usages.append(stopped.usage)
    server.wait_idle()
    after = snapshot(server)
    delta = {k: after[k] - before[k] for k in after}

    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    assert (delta["length"], delta["stop"], delta["abort"]) == (2, 1, 0)
    assert delta["vllm:prompt_tokens"] == prompt
    assert delta["vllm:generation_tokens"] == completion
    for name in PER_REQUEST:
        assert delta[name + "_count"] == 3, name
    assert delta["vllm:request_prompt_tokens_sum"] == prompt
    assert delta["vllm:request_generation_tokens_sum"] == completion
    assert delta["vllm:request_max_num_generation_tokens_sum"] == completion  # n = 1: the one completion
    assert delta["vllm:request_params_max_tokens_sum"] == sum(max_tokens)
    assert delta["vllm:request_params_n_sum"] == 3
    # one inter-token latency per token after the first; the per-request mean for requests of 2+ tokens
    assert delta["vllm:inter_token_latency_seconds_count"] == sum(u.completion_tokens - 1 for u in usages)
    assert delta["vllm:time_per_output_token_seconds_count"] == delta["vllm:inter_token_latency_seconds_count"]
    assert delta["vllm:request_time_per_output_token_seconds_count"] == sum(u.completion_tokens > 1 for u in usages)
    # the phases are measured on one clock: inference = prefill + decode, and a request is within its e2e
    assert delta["vllm:request_inference_time_seconds_sum"] == pytest.approx(
        delta["vllm:request_prefill_time_seconds_sum"] + delta["vllm:request_decode_time_seconds_sum"], abs=1e-6)
    assert delta["vllm:request_decode_time_seconds_sum"] == pytest.approx(
        delta["vllm:inter_token_latency_seconds_sum"], abs=1e-6)
    assert 0 < delta["vllm:request_inference_time_seconds_sum"] <= delta["vllm:e2e_request_latency_seconds_sum"]
    assert delta["vllm:request_queue_time_seconds_sum"] >= 0


def test_engine_state_and_prefix_cache_counters(server):
    client = server.client()
    server.wait_idle()
    before = families(server)
    prompt = "A prompt long enough to fill a few KV blocks of sixteen tokens, sent twice. " * 3
    for _ in range(2):
        client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0.0)
    server.wait_idle()
    after = families(server)
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0 == value(after, "vllm:gpu_cache_usage_perc")
    stats = server.engine.stats()
    assert value(after, "vllm:prefix_cache_queries", "_total") == stats["prefix_cache_queries"]
    hits = value(after, "vllm:prefix_cache_hits", "_total") - value(before, "vllm:prefix_cache_hits", "_total")
    assert hits >= 16  # the second request found at least one full block of the first
    assert value(after, "vllm:num_preemptions", "_total") == stats["num_preemptions"]
    # the llmplug_* twins are still there
    assert value(after, "llmplug_kv_cache_usage_perc") == 0.0


def test_speculative_decoding_counters_under_vllms_names(tiny_chat_model):
    engine = AsyncLLM(str(tiny_chat_model), speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                      **ENGINE_KWARGS)
    try:
        with serve(engine) as running:
            running.client().completions.create(model=running.model, prompt="one two one two one two one",
                                                max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
            running.wait_idle()
            fams = families(running)
        stats = engine.stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert fams[f"vllm:spec_decode_{name}"].type == "counter"
            assert value(fams, f"vllm:spec_decode_{name}", "_total") == stats[f"spec_decode_{name}"]
        per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
        assert len(per_pos) == 3 and sum(per_pos) == stats["spec_decode_num_accepted_tokens"] > 0
        for position, accepted in enumerate(per_pos):
            assert value(fams, "vllm:spec_decode_num_accepted_tokens_per_pos", "_total",
                         position=str(position)) == accepted
    finally:
        engine.shutdown()


def test_lora_requests_info_names_the_adapters_in_use():
    stats = {"num_running": 2, "max_loras": 4, "running_lora_adapters": ["sql", "chat"],
             "waiting_lora_adapters": ["math"]}
    metrics = ServerMetrics(lambda: stats, "base", 256)
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    [sample] = fams["vllm:lora_requests_info"].samples
    assert sample.labels == {"max_lora": "4", "running_lora_adapters": "sql,chat", "waiting_lora_adapters": "math"}
    assert sample.value == pytest.approx(time.time(), abs=60)  # vLLM's value: when the adapters were current
    assert "vllm:lora_requests_info" not in {f.name for f in text_string_to_metric_families(
        ServerMetrics(lambda: {"num_running": 0}, "base", 256).render().decode())}  # LoRA off: no series


def test_the_engine_reports_the_adapters_of_running_and_waiting_requests(tiny_chat_model):
    engine = AsyncLLM(str(tiny_chat_model), **ENGINE_KWARGS, enable_lora=True, max_lora_rank=16)
    try:
        stats = engine.stats()
        assert (stats["max_loras"], stats["running_lora_adapters"], stats["waiting_lora_adapters"]) == \
            (engine.config.lora.max_loras, [], [])
    finally:
        engine.shutdown()


def render(stats: dict) -> dict:
    metrics = ServerMetrics(lambda: stats, "base", 256)
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_iteration_tokens_histogram_is_the_engines_with_vllms_buckets():
    steps = StepHistogram()
    for num_tokens in (1, 1, 8, 9, 300, 20000):
        steps.observe(num_tokens)
    fams = render({"iteration_tokens": steps.snapshot()})
    family = fams["vllm:iteration_tokens_total"]
    assert family.type == "histogram"
    buckets = {float(s.labels["le"]): s.value for s in family.samples if s.name.endswith("_bucket")}
    assert list(buckets)[:-1] == list(ITERATION_TOKENS_BUCKETS)
    assert (buckets[1.0], buckets[8.0], buckets[16.0], buckets[512.0], buckets[16384.0], buckets[float("inf")]) == \
        (2, 3, 4, 5, 5, 6)  # cumulative, as Prometheus reads them
    assert value(fams, "vllm:iteration_tokens_total", "_count") == 6
    assert value(fams, "vllm:iteration_tokens_total", "_sum") == 1 + 1 + 8 + 9 + 300 + 20000


def test_engine_steps_reach_the_iteration_tokens_histogram(server):
    client = server.client()
    server.wait_idle()
    before = families(server)
    answer = client.completions.create(model=server.model, prompt="count the steps", max_tokens=4, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    server.wait_idle()
    after = families(server)
    steps = value(after, "vllm:iteration_tokens_total", "_count") - value(before, "vllm:iteration_tokens_total",
                                                                         "_count")
    tokens = value(after, "vllm:iteration_tokens_total", "_sum") - value(before, "vllm:iteration_tokens_total", "_sum")
    # one prefill step (the prompt fits the budget; prefix-cache hits are not run), then one per further token
    assert steps == answer.usage.completion_tokens
    usage = answer.usage
    assert usage.completion_tokens - 1 < tokens <= usage.prompt_tokens + usage.completion_tokens - 1


def test_corrupted_requests_and_mm_cache_counters_are_the_engines():
    fams = render({"num_corrupted_requests": 3, "mm_cache_queries": 5, "mm_cache_hits": 2})
    assert value(fams, "vllm:corrupted_requests", "_total") == 3
    assert value(fams, "vllm:mm_cache_queries", "_total") == 5 and value(fams, "vllm:mm_cache_hits", "_total") == 2
    assert fams["vllm:mm_cache_queries"].type == "counter" == fams["vllm:mm_cache_hits"].type
    assert "vllm:mm_cache_queries" not in render({"num_corrupted_requests": 0})  # a text-only model: no series


def test_waiting_requests_split_into_capacity_and_deferred():
    fams = render({"num_waiting": 5, "num_waiting_deferred": 2})
    assert value(fams, "vllm:num_requests_waiting_by_reason", reason="capacity") == 3
    assert value(fams, "vllm:num_requests_waiting_by_reason", reason="deferred") == 2
