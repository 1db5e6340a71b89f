"""FP8 experts of a mixture-of-experts checkpoint (quant_method "fp8"): every expert's gate_proj / up_proj /
down_proj `weight` in float8_e4m3fn with its `weight_scale_inv` 128x128 block scales (DeepSeek V3,
Qwen3-30B-A3B-FP8) or its per-tensor or per-channel `weight_scale` (vLLM's Mixtral FP8, compressed-tensors'
float-quantized schemes; a static `input_scale` is read and checked, not applied), as the linear layers of the same
checkpoint (llmplug.quantization.fp8).

Held, stacked over this rank's experts (I: this rank's intermediate features, H: hidden; S: the scale's name):

    gate_up_proj float8_e4m3fn [E, 2 I, H]   gate_up_proj_S float32 [E, 2 I, ceil(H / 128)] (else: [E, 2 I, 1])
    down_proj    float8_e4m3fn [E, H, I]     down_proj_S    float32 [E, H, ceil(I / 128)]    (else: [E, H, 1])

Scales are kept per output row (4 bytes per row and 128 columns: +3 %), so gate and up rows may be split anywhere
by tensor parallelism; down_proj's columns are split on 128-column blocks only (a size that cuts one is refused by
name). Computed as the fp8 linear method computes, per expert with tokens: on the CPU by llmplug's kernel
`fp8_matmul` (layers/kernels/native/fp8.cpp: each weight decoded, scaled and rounded to the activation dtype in
registers, float32 sums in a fixed order, so a row's bits never depend on how many rows its expert got); elsewhere
the projection is dequantized a tile of whole 128-row blocks at a time, float32(q) * scale rounded once to the
activation dtype (`dequantize_tile`: exactly transformers' and DeepSeek's dequantization), then multiplied with
F.linear, in batch-invariant mode by each tile's probed row plan (where none holds, `row_invariant` is False).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from llmplug.core.errors import ModelLoadError
from llmplug.layers.kernels.native import ops, use_native
from llmplug.layers.packed_linear import row_plan_for
from llmplug.layers.row_invariance import RowPlan
from llmplug.layers.weight_utils import ExpertShard
from llmplug.quantization.base import QuantizedExpertsMethod
from llmplug.quantization.fp8 import BLOCK, Fp8Scheme, dequantize_tile, static_input_scale, tile_rows

if TYPE_CHECKING:
    from llmplug.layers.moe.experts import FusedExperts
    from llmplug.layers.quantization import LinearOptions

__all__ = ["Fp8ExpertsMethod"]

log = logging.getLogger(__name__)

PROJECTIONS = ("gate_up_proj", "down_proj")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # all exact in float32


class Fp8ExpertsMethod(QuantizedExpertsMethod):
    """An fp8 checkpoint's experts: fp8 weights in memory, multiplied per expert as the fp8 linear layers are."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme, self.scale = scheme, scheme.scale_name
        self.dtype = torch.get_default_dtype()  # the model's: layers are built inside the loader's dtype context
        self.plans: dict[tuple[int, int, torch.dtype], RowPlan | None] | None = None  # None: plain F.linear
        self._row_invariant = True

    @property
    def row_invariant(self) -> bool:  # type: ignore[override]
        """Always on the CPU kernel (by construction); on the tile path, where batch-invariant mode found a row plan
        for every tile shape when the experts were loaded."""
        return self._row_invariant

    # ------------------------------------------------------------ loading

    def create_weights(self, experts: FusedExperts) -> None:
        i, h = experts.intermediate_size, experts.hidden_size
        _, slices = experts.slice_index
        if self.scheme.blocked and slices > 1 and i % BLOCK:
            raise ModelLoadError(
                f"{experts.prefix}: tensor parallelism splits each expert's {i * slices} intermediate features into "
                f"{slices} parts of {i}, which cuts down_proj's {BLOCK}-column fp8 scale blocks; choose a "
                "tensor_parallel_size that keeps them whole (or enable expert parallelism)"
            )
        for projection, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            experts.create_parameter(projection, projection, (n, k), torch.float8_e4m3fn, 0, 1)
            columns, column_dim = (math.ceil(k / BLOCK), 1) if self.scheme.blocked else (1, None)
            scale = experts.create_parameter(f"{projection}_{self.scale}", projection, (n, columns), torch.float32, 0,
                                             column_dim)
            scale.weight_loader = self._scale_loader(experts, projection, scale.weight_loader)
            if self.scheme.input_scale:
                experts.register_parameter(f"{projection}_input_scale", _input_scale(experts, projection))

    def _scale_loader(self, experts: FusedExperts, projection: str, load: Any) -> Any:
        """Checks one expert's checkpoint scale (dtype, shape) and expands it to one row per output feature."""
        name = f"{experts.prefix}.{projection}_{self.scale}"
        slices = experts.slice_index[1]
        rows, columns = experts.intermediate_size * slices, experts.hidden_size  # one checkpoint gate or up
        if projection == "down_proj":
            rows, columns = columns, rows

        def load_scale(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            if loaded.dtype not in _SCALE_DTYPES:
                raise ModelLoadError(f"{name} is {loaded.dtype} in the checkpoint; fp8 scales are float32 (or bf16)")
            if not self.scheme.blocked:  # one scale per tensor, or per output row (compressed-tensors' channel)
                per_row = loaded.numel() == rows and loaded.dim() <= 2 and loaded.shape[0] == rows
                if loaded.numel() != 1 and not per_row:
                    raise ModelLoadError(f"{name} has shape {tuple(loaded.shape)}; a [{rows} x {columns}] expert "
                                         f"weight takes one scale per tensor ([] or [1]) or per row ([{rows}, 1])")
                load(param, loaded.float().reshape(-1, 1).expand(rows, 1).contiguous(), shard_id)
                return
            expected = (math.ceil(rows / BLOCK), math.ceil(columns / BLOCK))
            if tuple(loaded.shape) != expected:
                raise ModelLoadError(f"{name} has shape {tuple(loaded.shape)}; a [{rows} x {columns}] expert weight "
                                     f"in {BLOCK}x{BLOCK} blocks has {list(expected)} block scales")
            load(param, loaded.float().repeat_interleave(BLOCK, 0)[:rows].contiguous(), shard_id)

        return load_scale

    def process_weights_after_loading(self, experts: FusedExperts, options: LinearOptions) -> None:
        """Check the loaded tensors; off the kernel in batch-invariant mode, probe the tiles' row plans."""
        for projection in PROJECTIONS:
            scale = getattr(experts, f"{projection}_{self.scale}").data
            if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
                raise ModelLoadError(f"{experts.prefix}.{projection}_{self.scale} has negative, infinite or NaN "
                                     "scales; the checkpoint is damaged")
            codes = getattr(experts, projection).data.view(torch.uint8)
            if bool(((codes & 0x7F) == 0x7F).any()):  # e4m3fn's only NaN codes
                raise ModelLoadError(f"{experts.prefix}.{projection} holds fp8 NaNs; the checkpoint is damaged")
        self.plans = {} if options.row_invariant else None
        weights = [getattr(experts, projection) for projection in PROJECTIONS]
        # the kernel's rows never depend on their number; the tile path's only by batch-invariant mode's row plans
        self._row_invariant = options.row_invariant or use_native(weights[0])
        if self.plans is None or use_native(weights[0]):
            return
        for n, k in (tuple(w.shape[1:]) for w in weights):  # [E, N, K]
            step = tile_rows(k)
            for start in range(0, n, step):
                self._plan(experts, min(step, n - start), k, self.dtype)

    # ------------------------------------------------------------ computing

    def apply(self, experts: FusedExperts, expert: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        weight, scale = getattr(experts, projection)[expert], getattr(experts, f"{projection}_{self.scale}")[expert]
        if use_native(x):
            return ops().fp8_matmul(x, weight, scale)  # [n, N]
        n, k = weight.shape  # weight [N, K], scale [N, K / 128] (per tensor: [N, 1])
        step = tile_rows(k)
        parts = []
        for start in range(0, n, step):
            stop = min(start + step, n)
            # the codes decode to value / 2^8 (fp8._decode_tile): the tile's scales carry the 2^8
            tile = dequantize_tile(weight[start:stop], scale[start:stop] * 256.0, 0, stop - start,
                                   self.scheme.blocked, x.dtype)
            plan = self._plan(experts, stop - start, k, x.dtype)
            parts.append(F.linear(x, tile) if plan is None else plan(lambda rows: F.linear(rows, tile), x))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [n, N]

    def _plan(self, experts: FusedExperts, rows: int, columns: int, dtype: torch.dtype) -> RowPlan | None:
        """The row plan of a [rows, columns] tile's F.linear in batch-invariant mode (None: one plain call)."""
        if self.plans is None:
            return None
        key = (rows, columns, dtype)
        if key not in self.plans:
            plan = row_plan_for("torch F.linear", rows, columns, dtype, torch.get_num_threads())
            if plan is None:
                log.warning("%s: F.linear on [%d x %d] %s tiles sums rows in an order that depends on their number "
                            "here; its results are not batch invariant", experts.prefix, rows, columns, dtype)
                self._row_invariant = False
            self.plans[key] = None if plan == RowPlan() else plan
        return self.plans[key]

    def dequantize(self, experts: FusedExperts, expert: int, projection: str) -> torch.Tensor:
        weight, scale = getattr(experts, projection)[expert], getattr(experts, f"{projection}_{self.scale}")[expert]
        return dequantize_tile(weight, scale * 256.0, 0, weight.shape[0], self.scheme.blocked, torch.float32)

    def __repr__(self) -> str:
        return f"fp8(w8a16, {'128x128 blocks' if self.scheme.blocked else 'per-tensor or per-row scales'})"


def _input_scale(experts: FusedExperts, projection: str) -> torch.nn.Parameter:
    """A static activation scale per expert and projection: read and checked, not applied (weight-only, as the fp8
    linear layers); gate and up keep the larger of theirs (they quantize the same input, as vLLM does)."""
    name = f"{experts.prefix}.{projection}_input_scale"

    def load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        local = experts.local_expert(shard_id)
        if local is not None:
            param.data[local] = max(static_input_scale(name, loaded), float(param.data[local]))

    parts = 2 if projection == "gate_up_proj" else 1
    param = torch.nn.Parameter(torch.zeros(experts.num_local_experts), requires_grad=False)
    param.weight_loader = load  # type: ignore[attr-defined]
    param.expected_shards = frozenset(  # type: ignore[attr-defined]
        ExpertShard(e, p) for e in range(experts.num_experts) for p in range(parts))
    return param
