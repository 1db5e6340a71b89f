"""docs/grafana/llmplug.json: every metric its PromQL reads is one the server exports, as the series type the
query's suffix needs, and it charts what an operator looks at first."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .test_vllm_metrics import scrape

DASHBOARD = Path(__file__).parents[3] / "docs" / "grafana" / "llmplug.json"
METRIC = re.compile(r"vllm:[a-zA-Z0-9_:]+")
# the series a family of each type exposes: suffix -> the types that have it
SUFFIXES = {"_bucket": {"histogram"}, "_sum": {"histogram"}, "_count": {"histogram"}, "_total": {"counter"}}
CHARTED = {  # what the dashboard must show: TTFT/ITL/e2e quantiles, scheduler, KV, throughput, prefix cache, ...
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens",
    "vllm:generation_tokens", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:num_preemptions",
}


def expressions(node) -> list[str]:
    """Every PromQL text in the dashboard: panel targets' `expr` and the template variables' queries."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        return found + [e for v in node.values() for e in expressions(v)]
    if isinstance(node, list):
        return [e for v in node for e in expressions(v)]
    return []


def family_of(series: str, types: dict[str, str]) -> str | None:
    """The exported family a series name belongs to: itself (a gauge, or a histogram's name in a template), or
    the name without the suffix its type exposes (_total of a counter; _bucket, _sum, _count of a histogram)."""
    if series in types and not series.endswith(tuple(SUFFIXES)):
        return series
    for suffix, kinds in SUFFIXES.items():
        base = series.removesuffix(suffix)
        if series.endswith(suffix) and types.get(base) in kinds:
            return base
    return None


def test_family_of_strips_only_the_suffix_the_type_has():
    types = {"vllm:a": "counter", "vllm:b": "histogram", "vllm:c": "gauge"}
    assert family_of("vllm:a_total", types) == "vllm:a"
    assert family_of("vllm:b_bucket", types) == family_of("vllm:b_count", types) == "vllm:b"
    assert family_of("vllm:c", types) == "vllm:c"
    assert family_of("vllm:c_total", types) is None  # a gauge has no _total series
    assert family_of("vllm:a_bucket", types) is None
    assert family_of("vllm:d", types) is None


def test_every_metric_the_dashboard_reads_is_exported(server):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    assert len(exprs) >= 12
    referenced = {name for expr in exprs for name in METRIC.findall(expr)}
    types = {f.name: f.type for f in text_string_to_metric_families(scrape(server))}
    unknown = sorted(name for name in referenced if family_of(name, types) is None)
    assert not unknown, f"the dashboard reads series the server does not export: {unknown}"
    charted = {family_of(name, types) for name in referenced}
    assert CHARTED <= charted, f"not charted: {sorted(CHARTED - charted)}"


def test_quantile_panels_read_histogram_buckets():
    exprs = expressions(json.loads(DASHBOARD.read_text()))
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert any(f"histogram_quantile(0.99, sum by (le) (rate(vllm:{metric}_bucket" in e for e in exprs), metric
