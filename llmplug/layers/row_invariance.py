"""Row plans: how a packed matmul is called so that each row's bits do not depend on how many rows share the call.

A vendor GEMM chooses its kernel and its blocking from the problem's shape, so the order in which it sums a row
over K can change with the number of rows M: oneDNN on AVX-512 computes a lone row of a long reduction with a
matrix-vector kernel, and its AMX kernels reduce in an M-dependent order (docs/determinism.md). Which shapes do
that depends on the CPU, the ISA oneDNN runs (`ONEDNN_MAX_CPU_ISA`) and the thread count, so it is probed on
the machine the engine runs on, per weight shape, and the cheapest plan that holds is kept:

- ``any rows``: one call whatever M (the kernel is invariant);
- ``at least N rows``: a call of fewer rows is padded to N (the kernel is invariant from N rows on);
- ``tiles of T rows``: every call has exactly T rows, the last padded (one fixed kernel configuration);
- none: nothing holds, and batch-invariant mode cannot hold for that shape (the engine says so at start-up).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llmplug.core.cache import cache_dir
from llmplug.core.cpuinfo import cpu_flags, cpu_model_name

__all__ = [
    "PROBED_ROW_COUNTS", "RowPlan", "cached_row_plan", "cancelling_weight", "find_row_plan", "order_sensitive_rows",
    "remembered_probe",
]

log = logging.getLogger(__name__)

Matmul = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> y [M, N]

# The row counts whose rows the probe compares with the same rows in a call of the most rows: every count to
# 64 (where kernels switch between matrix-vector and small-matrix code, and where the smaller blockings sit),
# then both sides of each power of two to 1024 (where blockings are chosen by size classes).
PROBED_ROW_COUNTS = (*range(1, 65), *(n + d for n in (128, 256, 512, 1024) for d in (-1, 0, 1)))
# the most rows a plan may pad a call to: beyond this a small batch pays more than a tile plan's padding
MAX_MIN_ROWS = 64
TILE_ROWS = (32, 16, 8)  # tile plans tried, largest first: fewer calls for long prefills


@dataclass(frozen=True, slots=True)
class RowPlan:
    """How to call a matmul so that each row's result is the same for any number of rows.

    min_rows: a call of fewer rows is padded (with zero rows) to this many. tile: when set, rows go through in
    calls of exactly `tile` rows, the last one padded; `min_rows` is then unused.
    """

    min_rows: int = 1
    tile: int | None = None

    def __call__(self, matmul: Matmul, x: torch.Tensor) -> torch.Tensor:
        """matmul(x) for a 2-D x [M, K], computed the plan's way."""
        rows = x.shape[0]
        if self.tile is not None:
            tiles = _pad_rows(x, -(-rows // self.tile) * self.tile).split(self.tile)
            return torch.cat([matmul(tile) for tile in tiles])[:rows]
        if rows < self.min_rows:
            return matmul(_pad_rows(x, self.min_rows))[:rows]
        return matmul(x)

    def __str__(self) -> str:
        if self.tile is not None:
            return f"tiles of {self.tile} rows"
        return "any rows" if self.min_rows == 1 else f"at least {self.min_rows} rows"


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


def order_sensitive_rows(rows: int, in_features: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """x [rows, K] such that, times a `cancelling_weight`, any change of summation order changes a row's bits.

    Each row holds +2^20 and -2^20 at two columns; the caller's weight must have equal columns there (see
    `cancelling_weight`), so the two products cancel exactly but the small terms summed between them lose low
    bits to the large running sum, by how many depending on the order. Equal orders give equal bits.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    for row in range(rows):
        first, last = row % 4, in_features - 1 - row % 4
        x[row, first], x[row, last] = 2.0**20, -(2.0**20)
    return x.to(dtype)


def cancelling_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A float32 weight [N, K] whose columns i and K-1-i are equal for i < 4 (see `order_sensitive_rows`)."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed + 1))
    for first in range(4):
        weight[:, in_features - 1 - first] = weight[:, first]
    return weight


def find_row_plan(matmul: Matmul, in_features: int, dtype: torch.dtype, max_rows: int = 1025) -> RowPlan | None:
    """The cheapest plan under which `matmul` gives every row the same bits for any row count, or None.

    `matmul` is probed as it runs here (its weight packed as the layer's is): every count of PROBED_ROW_COUNTS up
    to `max_rows`, each starting at another row (so that rows also move within the call), against the same rows
    in one call of more rows than any; then calls of exactly TILE_ROWS rows with each row at every position of a
    tile, beside other rows.
    """
    counts = [m for m in PROBED_ROW_COUNTS if m <= max_rows]
    x = order_sensitive_rows(max(counts[-1] + _SHIFTS, 2 * TILE_ROWS[0]), in_features, dtype)
    reference = matmul(x)
    windows = {m: slice(_shift(m), _shift(m) + m) for m in counts}
    differing = [m for m, rows in windows.items() if not torch.equal(matmul(x[rows]), reference[rows])]
    if not differing:
        return RowPlan()
    if differing[-1] < MAX_MIN_ROWS and differing == counts[: len(differing)]:
        return RowPlan(min_rows=differing[-1] + 1)  # every count from there on agrees with the most rows
    return next((RowPlan(tile=tile) for tile in TILE_ROWS if _tile_invariant(matmul, x, tile)), None)


_SHIFTS = 29  # a probed call of m rows starts at row _shift(m) < _SHIFTS: a row sits at other positions


def _shift(rows: int) -> int:
    return 3 * rows % _SHIFTS


def _tile_invariant(matmul: Matmul, x: torch.Tensor, tile: int) -> bool:
    """Whether calls of exactly `tile` rows give each row the same bits at every position and beside any rows."""
    first = matmul(x[:tile])  # rows 0..tile-1 at their own positions
    for shift in range(1, tile):
        shifted = matmul(x[shift : shift + tile])  # row r now at position r - shift, beside other rows
        if not torch.equal(shifted[: tile - shift], first[shift:]):
            return False
    return True


# ---------------------------------------------------------------- probes remembered per machine


def _kernel_fingerprint() -> str:
    """What decides which kernels run: the CPU (model and flags), torch and oneDNN builds, the ISA cap, threads."""
    parts = [
        cpu_model_name(), " ".join(sorted(cpu_flags())), torch.__version__, str(torch.backends.mkldnn.is_available()),
        os.environ.get("ONEDNN_MAX_CPU_ISA", ""), os.environ.get("DNNL_MAX_CPU_ISA", ""), str(torch.get_num_threads()),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def remembered_probe(name: str, probe: Callable[[], Any]) -> Any:
    """`probe()`'s answer (a JSON value), remembered on disk for this machine's kernel fingerprint: a probe of a
    large shape costs seconds, and every engine start (every worker) would pay it again."""
    path = cache_dir() / "row_plans" / _kernel_fingerprint() / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass  # not probed here yet, or an unreadable entry: probe again
    answer = probe()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(answer, f)
        os.replace(f.name, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError as error:
        log.info("probe %s not remembered (%s): it runs again next start", name, error)
    return answer


def cached_row_plan(name: str, probe: Callable[[], RowPlan | None]) -> RowPlan | None:
    """`probe()`'s plan for the kernel `name`, remembered on disk (`remembered_probe`)."""
    def plan_as_json() -> dict[str, Any] | None:
        plan = probe()
        return None if plan is None else {"min_rows": plan.min_rows, "tile": plan.tile}

    stored = remembered_probe(name, plan_as_json)
    try:
        return None if stored is None else RowPlan(**stored)
    except TypeError:  # an entry of another form: probe again, unremembered
        return probe()
