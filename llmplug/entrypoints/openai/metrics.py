"""Prometheus metrics of the server (`GET /metrics`), in a registry of their own per app.

Per request: outcome counts, prompt and generated tokens, time to first token, time per output token
and end-to-end latency. Engine gauges (running / waiting requests, KV-cache usage, prefix-cache hit
rate), the preemption counter and, with speculative decoding, the draft counters, acceptance rate and mean
accepted length are read from `AsyncLLM.stats()` when scraped; with data-parallel replicas, whether each replica
serves and its restarts (`engine` label), and vLLM's engine series once per replica. Per HTTP response: counts by endpoint and status.

Every metric is exported twice: as `llmplug_*` (our own names) and under vLLM's v1 names, types, labels
(`model_name`, `engine`) and buckets (`vllm:*`, see `vllm_metrics`), which dashboards, autoscalers and
routers built for vLLM read. docs/observability.md lists both and the vLLM metrics left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from llmplug.core.outputs import RequestMetrics, RequestOutput
from llmplug.core.params import SamplingParams
from llmplug.entrypoints.openai.vllm_metrics import VllmMetrics

if TYPE_CHECKING:
    from llmplug.engine.data_parallel import ReplicaState
    from llmplug.entrypoints.openai.loggable import RequestLogger
    from llmplug.entrypoints.openai.tracing import RequestTracer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# How a request ended: the finish reason of its completions, or an error.
OUTCOMES = ("stop", "length", "abort", "error")

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    """Gauges read from the engine's stats at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        yield GaugeMetricFamily("llmplug_num_requests_running", "Requests in the running batch.",
                                value=stats.get("num_running", 0))
        yield GaugeMetricFamily("llmplug_num_requests_waiting", "Requests waiting to be scheduled.",
                                value=stats.get("num_waiting", 0))
        yield GaugeMetricFamily("llmplug_kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0-1).",
                                value=stats.get("kv_cache_usage", 0.0))
        yield GaugeMetricFamily("llmplug_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache per token "
                                "looked up (0-1), since start.", value=stats.get("prefix_cache_hit_rate", 0.0))
        # a counter (exposed as llmplug_num_preemptions_total): rate() over it gives preemptions per second
        yield CounterMetricFamily("llmplug_num_preemptions", "Requests preempted (KV blocks taken back) since start.",
                                  value=stats.get("num_preemptions", 0))
        if "spec_decode_num_drafts" in stats:  # speculative decoding (vLLM's spec_decode counters)
            yield from _spec_decode_metrics(stats)


class _ReplicaCollector(Collector):
    """Data-parallel replicas: whether each serves, and how often it was restarted (label `engine`: its index)."""

    def __init__(self, replicas: Callable[[], list[ReplicaState]]):
        self._replicas = replicas

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily("llmplug_dp_replica_up", "1 while the data-parallel replica serves requests, else 0 "
                               "(starting, restarting, failed).", labels=["engine"])
        restarts = CounterMetricFamily("llmplug_dp_replica_restarts", "Times the data-parallel replica was started "
                                       "again after its process died.", labels=["engine"])
        for state in self._replicas():
            up.add_metric([str(state.index)], 1 if state.status == "running" else 0)
            restarts.add_metric([str(state.index)], state.restarts)
        yield up
        yield restarts


def _spec_decode_metrics(stats: dict[str, Any]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Draft counts (counters) and the acceptance rate and mean accepted length since start (gauges)."""
    for name, what in (("num_drafts", "Request-steps that verified draft tokens"),
                       ("num_draft_tokens", "Draft tokens proposed"),
                       ("num_accepted_tokens", "Draft tokens accepted")):
        yield CounterMetricFamily(f"llmplug_spec_decode_{name}", f"{what}, since start.",
                                  value=stats[f"spec_decode_{name}"])
    yield GaugeMetricFamily("llmplug_spec_decode_acceptance_rate", "Accepted per proposed draft token (0-1), "
                            "since start.", value=stats["spec_decode_acceptance_rate"])
    yield GaugeMetricFamily("llmplug_spec_decode_mean_accepted_length", "Tokens a speculating request gains per "
                            "step (accepted drafts + 1), since start.", value=stats["spec_decode_mean_accepted_length"])


class ServerMetrics:
    """The server's metrics; `track()` follows one request from arrival to its end (and, when they are on, logs
    the request and makes its trace span)."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]], model_name: str = "",
                 max_model_len: int = 1024, cache_info: dict[str, str] | None = None,
                 tracer: RequestTracer | None = None, request_logger: RequestLogger | None = None,
                 replicas: Callable[[], list[ReplicaState]] | None = None):
        self.registry = CollectorRegistry()
        self.tracer = tracer  # with tracing on: a span per request, made when its tracker records it
        self.request_logger = request_logger  # with --enable-log-requests: a log line per request as it arrives
        r = self.registry
        self.requests = Counter("llmplug_requests", "Generation requests by how they ended.", ["outcome"], registry=r)
        self.prompt_tokens = Counter("llmplug_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("llmplug_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("llmplug_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llmplug_time_per_output_token_seconds", "Mean time between generated tokens "
                              "of a request.", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("llmplug_e2e_request_latency_seconds", "Arrival to the end of the request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.http = Counter("llmplug_http_responses", "HTTP responses by endpoint and status.",
                            ["endpoint", "status"], registry=r)
        for outcome in OUTCOMES:  # every outcome shows up from the start, at 0
            self.requests.labels(outcome)
        r.register(_EngineCollector(engine_stats))
        engines = None
        if replicas is not None:
            r.register(_ReplicaCollector(replicas))
            engines = lambda: [(str(state.index), state.stats) for state in replicas()]  # noqa: E731
        self.vllm = VllmMetrics(r, engine_stats, model_name, max_model_len, cache_info or {}, engines)

    def track(self, num_prompt_tokens: int, params: SamplingParams | None = None,
              request_id: str | None = None) -> "RequestTracker":
        """A tracker for a request that arrives now (`params` and `request_id`: for vLLM's histograms and spans)."""
        return RequestTracker(self, num_prompt_tokens, params, request_id)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


class RequestTracker:
    """Follows one request through its outputs and records it once, when it ends.

    Latencies come from the engine's own timestamps (`RequestOutput.metrics`: arrival at the engine,
    first token, finish), so streamed and non-streamed requests are measured alike.
    """

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, params: SamplingParams | None = None,
                 request_id: str | None = None):
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.request_id = request_id
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.engine_metrics: RequestMetrics | None = None  # the engine's timestamps, from its latest output
        self.engine = "0"  # the `engine` label of its vllm:* series: the data-parallel replica that runs it
        self.num_cached_tokens = 0
        self.num_generated: dict[int, int] = {}  # completion index -> tokens so far
        self.prompt_counted = False  # vllm:prompt_tokens counts a prompt once its prefill gave a token
        self.done = False

    def observe(self, output: RequestOutput, delta: bool) -> None:
        """Count an output's tokens (added when `delta`, else the totals so far); close on the final one."""
        if output.prompt_token_ids:  # the engine's count, image placeholders expanded
            self.num_prompt_tokens = len(output.prompt_token_ids)
        generated, new_tokens = self.num_generated, 0  # runs once per streamed token: no sums over the completions
        for completion in output.outputs:
            count, seen = len(completion.token_ids), generated.get(completion.index, 0)
            generated[completion.index] = seen + count if delta else count
            new_tokens += count if delta else count - seen
        self.num_cached_tokens = output.num_cached_tokens
        engine_metrics = output.metrics
        if engine_metrics is not None:
            self.engine = str(engine_metrics.engine_index)
        if new_tokens > 0:  # counted as they come, so rate() shows throughput while requests run
            prompt_tokens = 0 if self.prompt_counted else self.num_prompt_tokens
            self.prompt_counted = True
            self.metrics.vllm.count_tokens(self.engine, prompt_tokens, new_tokens)
        if engine_metrics is not None:
            self.engine_metrics = engine_metrics
            self.arrival_time = engine_metrics.arrival_time
            self.first_token_time = engine_metrics.first_token_time or self.first_token_time
        if output.finished:
            reasons = {c.finish_reason for c in output.outputs}
            outcome = "abort" if "abort" in reasons else "length" if "length" in reasons else "stop"
            self.finish(outcome, output.metrics.finished_time if output.metrics else None)

    def finish(self, outcome: str, end_time: float | None = None) -> None:
        """Record the request (once): its outcome, tokens and latencies."""
        if self.done:
            return
        self.done = True
        end_time = end_time or time.time()
        m = self.metrics
        m.requests.labels(outcome).inc()
        m.prompt_tokens.inc(self.num_prompt_tokens)
        generated = sum(self.num_generated.values())
        m.generation_tokens.inc(generated)
        m.e2e.observe(max(end_time - self.arrival_time, 0.0))
        if self.first_token_time is not None:
            m.ttft.observe(max(self.first_token_time - self.arrival_time, 0.0))
            per_sequence = generated / max(len(self.num_generated), 1)
            if per_sequence > 1:
                m.tpot.observe(max(end_time - self.first_token_time, 0.0) / (per_sequence - 1))
        m.vllm.record_finished(self, outcome, end_time)
        if m.tracer is not None:
            m.tracer.record(self, end_time)
