"""The numbers `llmplug bench` prints, in the layout of vLLM's `vllm bench` summaries."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)  # those `vllm bench latency` prints


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between ranks (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


@dataclass(slots=True)
class RequestTiming:
    """One streamed request as the client saw it (seconds)."""

    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0  # request sent to first token
    latency: float = 0.0  # request sent to last token
    itl: list[float] = field(default_factory=list)  # gaps between streamed tokens
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with one token or less."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _line(name: str, value: float | int | str) -> str:
    if isinstance(value, float):
        return f"{name:<40} {value:<10.2f}"
    return f"{name:<40} {value:<10}"


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^50}"


def serving_summary(results: list[RequestTiming], duration: float, max_concurrency: int | None,
                    request_rate: float) -> str:
    """vLLM's "Serving Benchmark Result" block."""
    ok = [r for r in results if r.error is None]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    lines = [_rule(" Serving Benchmark Result ", "="),
             _line("Successful requests:", len(ok)),
             _line("Failed requests:", len(results) - len(ok))]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    lines += [_line("Request rate configured (RPS):", "inf" if request_rate == float("inf") else request_rate),
              _line("Benchmark duration (s):", duration),
              _line("Total input tokens:", input_tokens),
              _line("Total generated tokens:", output_tokens),
              _line("Request throughput (req/s):", len(ok) / duration),
              _line("Output token throughput (tok/s):", output_tokens / duration),
              _line("Total Token throughput (tok/s):", (input_tokens + output_tokens) / duration)]
    ms = {"TTFT": [r.ttft * 1000 for r in ok], "TPOT": [r.tpot * 1000 for r in ok if r.tpot is not None],
          "ITL": [gap * 1000 for r in ok for gap in r.itl], "E2EL": [r.latency * 1000 for r in ok]}
    titles = {"TTFT": "Time to First Token", "TPOT": "Time per Output Token (excl. 1st token)",
              "ITL": "Inter-token Latency", "E2EL": "End-to-end Latency"}
    for key, values in ms.items():
        lines += [_rule(titles[key], "-"),
                  _line(f"Mean {key} (ms):", mean(values)),
                  _line(f"Median {key} (ms):", median(values)),
                  _line(f"P99 {key} (ms):", percentile(values, 99))]
    lines.append("=" * 50)
    return "\n".join(lines)


def throughput_summary(num_requests: int, prompt_tokens: int, output_tokens: int, elapsed: float) -> str:
    """vLLM's `bench throughput` lines."""
    total = prompt_tokens + output_tokens
    return (f"Throughput: {num_requests / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
            f"{output_tokens / elapsed:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {prompt_tokens}\n"
            f"Total num output tokens:  {output_tokens}")


def latency_summary(latencies: Sequence[float]) -> str:
    """vLLM's `bench latency` lines: the mean and percentiles of one batch's latency, in seconds."""
    lines = [f"Avg latency: {mean(latencies)} seconds"]
    lines += [f"{q}% percentile latency: {percentile(latencies, q)} seconds" for q in LATENCY_PERCENTILES]
    return "\n".join(lines)
