"""The server's metrics under vLLM's v1 names (`vllm:*`): the names, types, labels and buckets of vLLM's
`PrometheusStatLogger`, so that dashboards, autoscalers and routers written for vLLM read llmplug as they are.

Every series carries `model_name` (the first served name) and `engine` ("0": one engine core per server; with
data-parallel replicas, the engine gauges and counters come once per replica, `engine` its index, and a request's
series are those of the replica that ran it).
Engine state (running / waiting requests, KV-cache usage, prefix-cache, encoder-cache, preemption and
corrupted-request counters, speculative decoding and LoRA) is read from `AsyncLLM.stats()` at scrape time, and
so is the tokens-per-step histogram the engine core keeps at every step; per-request metrics are recorded by the
`RequestTracker` of `metrics.py` from the engine's own timestamps (`RequestMetrics`). What vLLM exports and
llmplug cannot measure is left out, never exported as a made-up value (docs/observability.md lists it).

Differences that remain: a request with n > 1 counts once (its prompt once, as its `usage` does; vLLM counts
each of the n child requests); `vllm:lora_requests_info` holds only the current adapters' series.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from llmplug.entrypoints.openai.metrics import RequestTracker
    from llmplug.engine.step_histogram import StepHistogramSnapshot

LABELS = ["model_name", "engine"]
ENGINE = "0"  # the engine index: one engine core behind each server
FINISHED_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, each a series from the start

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    """vLLM's per-request metrics (labelled with the engine that ran the request: its data-parallel replica) and,
    registered beside them, its engine gauges."""

    def __init__(self, registry: CollectorRegistry, engine_stats: Callable[[], dict[str, Any]], model_name: str,
                 max_model_len: int, cache_info: dict[str, str],
                 engines: Callable[[], list[tuple[str, dict[str, Any]]]] | None = None):
        self.model_name = model_name
        r = registry
        tokens = build_1_2_5_buckets(max_model_len)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=r)

        def histogram(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       [*LABELS, "finished_reason"], registry=r)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", tokens)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            tokens)
        self.request_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = histogram("vllm:request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", tokens)
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tokens)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(  # vLLM's older name of the same measurement, still exported
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. DEPRECATED: use vllm:inter_token_latency_seconds.",
            TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS)
        self.phases = {phase: histogram(f"vllm:{name}", doc, REQUEST_LATENCY_BUCKETS) for phase, name, doc in (
            ("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            ("queue", "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
            ("inference", "request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
            ("prefill", "request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
            ("decode", "request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
        )}
        if cache_info:
            info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*cache_info, "engine"],
                         registry=r)
            info.labels(*cache_info.values(), ENGINE).set(1)
        # each engine's (prompt, generation) token counter series, looked up once: they grow at every streamed token
        self._token_counters: dict[str, tuple[Any, Any]] = {}
        engines = engines or (lambda: [(ENGINE, engine_stats())])
        for engine, _ in engines():  # every engine's per-request series from the start, at 0
            self._create_series(engine)
        r.register(_VllmEngineCollector(engines, model_name))

    def _create_series(self, engine: str) -> None:
        """The per-request series of engine `engine`, at 0 (prometheus_client adds a series at its first use)."""
        labels = (self.model_name, engine)
        for metric in (self.prompt_tokens, self.generation_tokens, self.request_prompt_tokens,
                       self.request_generation_tokens, self.request_max_num_generation_tokens, self.request_params_n,
                       self.request_params_max_tokens, self.request_prefill_kv_computed_tokens, self.ttft,
                       self.inter_token_latency, self.time_per_output_token, self.request_time_per_output_token,
                       *self.phases.values()):
            metric.labels(*labels)
        for reason in FINISHED_REASONS:
            self.request_success.labels(*labels, reason)

    def count_tokens(self, engine: str, prompt_tokens: int, generation_tokens: int) -> None:
        """Add to vllm:prompt_tokens and vllm:generation_tokens of `engine` (as tokens come, not when requests end)."""
        counters = self._token_counters.get(engine)
        if counters is None:
            labels = (self.model_name, engine)
            counters = self._token_counters[engine] = (self.prompt_tokens.labels(*labels),
                                                       self.generation_tokens.labels(*labels))
        if prompt_tokens:
            counters[0].inc(prompt_tokens)
        counters[1].inc(generation_tokens)

    def record_finished(self, tracker: RequestTracker, outcome: str, end_time: float) -> None:
        """Record a request that ended (`outcome`: a finish reason, or "error", which is no success) under the
        engine that ran it."""
        labels = (self.model_name, tracker.engine)
        if outcome in FINISHED_REASONS:
            self.request_success.labels(*labels, outcome).inc()
        generated = list(tracker.num_generated.values())
        self.request_prompt_tokens.labels(*labels).observe(tracker.num_prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(sum(generated))
        self.request_max_num_generation_tokens.labels(*labels).observe(max(generated, default=0))
        if tracker.params is not None:
            self.request_params_n.labels(*labels).observe(tracker.params.n)
            if tracker.params.max_tokens is not None:
                self.request_params_max_tokens.labels(*labels).observe(tracker.params.max_tokens)
        if tracker.prompt_counted:  # its prefill ran: the prompt tokens the prefix cache did not hold were computed
            self.request_prefill_kv_computed_tokens.labels(*labels).observe(
                max(tracker.num_prompt_tokens - tracker.num_cached_tokens, 0))
        self.phases["e2e"].labels(*labels).observe(max(end_time - tracker.arrival_time, 0.0))
        if tracker.engine_metrics is not None:
            self._record_phases(labels, tracker, max(generated, default=0))

    def _record_phases(self, labels: tuple[str, str], tracker: RequestTracker, longest: int) -> None:
        """The engine-measured phases of the request: only those its timestamps cover (an aborted request may
        never have been scheduled, or never have given a token)."""
        m = tracker.engine_metrics
        spans = {
            "queue": (m.arrival_time, m.first_scheduled_time),
            "prefill": (m.first_scheduled_time, m.first_token_time),
            "decode": (m.first_token_time, m.last_token_time),
            "inference": (m.first_scheduled_time, m.last_token_time),
        }
        for phase, (start, end) in spans.items():
            if start is not None and end is not None:
                self.phases[phase].labels(*labels).observe(max(end - start, 0.0))
        if m.first_token_time is not None:
            self.ttft.labels(*labels).observe(max(m.first_token_time - m.arrival_time, 0.0))
        if m.finished_time is None:  # not the engine's final output: its inter-token latencies may be incomplete
            return
        inter_token, per_output_token = (self.inter_token_latency.labels(*labels),
                                         self.time_per_output_token.labels(*labels))
        for latency in m.inter_token_latencies:
            inter_token.observe(latency)
            per_output_token.observe(latency)
        if longest > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.request_time_per_output_token.labels(*labels).observe(
                (m.last_token_time - m.first_token_time) / (longest - 1))


class _VllmEngineCollector(Collector):
    """vLLM's engine gauges and counters, read from the engine's stats at scrape time."""

    def __init__(self, engines: Callable[[], list[tuple[str, dict[str, Any]]]], model_name: str):
        self._engines = engines
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        """Every engine's series (one per data-parallel replica, by its `engine` label) in one family per name."""
        families: dict[str, Metric] = {}
        for engine, stats in self._engines():
            for family in _EngineSeries([self._model_name, engine]).collect(stats):
                merged = families.setdefault(family.name, family)
                if merged is not family:  # a series without the engine label (lora info) is the same in each
                    seen = {(sample.name, tuple(sorted(sample.labels.items()))) for sample in merged.samples}
                    merged.samples.extend(sample for sample in family.samples
                                          if (sample.name, tuple(sorted(sample.labels.items()))) not in seen)
        yield from families.values()


class _EngineSeries:
    """One engine's series, labelled with `values` (model name, engine index)."""

    def __init__(self, values: list[str]):
        self._values = values

    def _family(self, kind: type, name: str, doc: str, value: float) -> GaugeMetricFamily | CounterMetricFamily:
        family = kind(name, doc, labels=LABELS)
        family.add_metric(self._values, value)
        return family

    def collect(self, stats: dict[str, Any]) -> Iterator[Metric]:
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        usage = stats.get("kv_cache_usage", 0.0)
        yield self._family(gauge, "vllm:num_requests_running", "Number of requests in model execution batches.",
                           stats.get("num_running", 0))
        yield self._family(gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                           stats.get("num_waiting", 0))
        yield self._waiting_by_reason(stats)
        yield self._family(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield self._family(gauge, "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."
                           "DEPRECATED: Use vllm:kv_cache_usage_perc instead.", usage)
        for prefix, deprecated in (("", ""), ("gpu_", " DEPRECATED: Use vllm:prefix_cache_{} instead.")):
            yield self._family(counter, f"vllm:{prefix}prefix_cache_queries", "Prefix cache queries, in terms of "
                               "number of queried tokens." + deprecated.format("queries"),
                               stats.get("prefix_cache_queries", 0))
            yield self._family(counter, f"vllm:{prefix}prefix_cache_hits", "Prefix cache hits, in terms of number of "
                               "cached tokens." + deprecated.format("hits"), stats.get("prefix_cache_hits", 0))
        yield self._family(counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                           stats.get("num_preemptions", 0))
        yield self._family(counter, "vllm:corrupted_requests", "Corrupted requests, in terms of total number of "
                           "requests with NaNs in logits.", stats.get("num_corrupted_requests", 0))
        if "iteration_tokens" in stats:
            yield self._histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  stats["iteration_tokens"])
        if "mm_cache_queries" in stats:  # a multimodal model
            yield self._family(counter, "vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of "
                               "queried items.", stats["mm_cache_queries"])
            yield self._family(counter, "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached "
                               "items.", stats["mm_cache_hits"])
        if "spec_decode_num_drafts" in stats:  # speculative decoding on
            yield from self._spec_decode(stats)
        if "max_loras" in stats:  # LoRA on
            yield _lora_info(stats)

    def _waiting_by_reason(self, stats: dict[str, Any]) -> GaugeMetricFamily:
        """The waiting requests split: "deferred" (grammar compiling, no adapter slot) and "capacity" (the rest)."""
        family = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: 'capacity' = "
            "waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
            "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*LABELS, "reason"])
        deferred = stats.get("num_waiting_deferred", 0)
        family.add_metric([*self._values, "capacity"], stats.get("num_waiting", 0) - deferred)
        family.add_metric([*self._values, "deferred"], deferred)
        return family

    def _histogram(self, name: str, doc: str, snapshot: StepHistogramSnapshot) -> HistogramMetricFamily:
        """A histogram the engine accumulated, with Prometheus's cumulative buckets."""
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        cumulative = list(itertools.accumulate(snapshot.counts))
        buckets = [(str(float(bound)), n) for bound, n in zip(snapshot.bounds, cumulative)]
        family.add_metric(self._values, [*buckets, ("+Inf", snapshot.count)], snapshot.sum)
        return family

    def _spec_decode(self, stats: dict[str, Any]) -> Iterator[CounterMetricFamily]:
        """vLLM's speculative-decoding counters, the accepted drafts by draft position among them."""
        for name, doc in (("num_drafts", "Number of spec decoding drafts."),
                          ("num_draft_tokens", "Number of draft tokens."),
                          ("num_accepted_tokens", "Number of accepted tokens.")):
            yield self._family(CounterMetricFamily, f"vllm:spec_decode_{name}", doc, stats[f"spec_decode_{name}"])
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*LABELS, "position"])
        for position, accepted in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", ())):
            per_pos.add_metric([*self._values, str(position)], accepted)
        yield per_pos


def _lora_info(stats: dict[str, Any]) -> GaugeMetricFamily:
    """vllm:lora_requests_info: the adapters in use, as labels; the value is when they were read (unix time)."""
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    family.add_metric([str(stats["max_loras"]), ",".join(stats["waiting_lora_adapters"]),
                       ",".join(stats["running_lora_adapters"])], time.time())
    return family


def cache_config_info(engine: Any) -> dict[str, str]:
    """The labels of vllm:cache_config_info: the KV-cache settings under vLLM's CacheConfig names."""
    cache, core = engine.config.cache, engine.llm_engine.engine_core
    kv = core.kv_cache_manager
    return {
        "block_size": str(cache.block_size),
        "gpu_memory_utilization": str(cache.memory_fraction),
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "num_gpu_blocks_override": str(cache.num_blocks),
        "num_gpu_blocks": str(kv.num_blocks if kv is not None else 0),
    }
