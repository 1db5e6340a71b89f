"""Tokens per engine step as a cumulative histogram, kept by the engine core and read by metrics exporters.

The server reads the engine's stats when it is scraped, not at every step, so a per-step distribution has to be
accumulated where the steps run. Each step costs one bisect and three integer additions.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

__all__ = ["ITERATION_TOKENS_BUCKETS", "StepHistogram", "StepHistogramSnapshot"]

# vLLM's v1 buckets of vllm:iteration_tokens_total (upper bounds, inclusive); +Inf is implied
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True, frozen=True)
class StepHistogramSnapshot:
    """The observations so far: `counts[i]` fell in (bounds[i-1], bounds[i]], the last entry above every bound."""

    bounds: tuple[int, ...]
    counts: tuple[int, ...]  # len(bounds) + 1, not cumulative
    sum: int
    count: int


class StepHistogram:
    """Counts of per-step values by bucket, with their sum and number (engine thread only)."""

    def __init__(self, bounds: tuple[int, ...] = ITERATION_TOKENS_BUCKETS) -> None:
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0
        self._count = 0

    def observe(self, value: int) -> None:
        """Count one step of `value` tokens (Prometheus buckets: a value equal to a bound falls in it)."""
        self._counts[bisect_left(self.bounds, value)] += 1
        self._sum += value
        self._count += 1

    def snapshot(self) -> StepHistogramSnapshot:
        """An immutable copy, safe to hand to another thread."""
        return StepHistogramSnapshot(self.bounds, tuple(self._counts), self._sum, self._count)
