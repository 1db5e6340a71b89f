"""FP8 checkpoints (quant_method "fp8": DeepSeek V3, Qwen3-FP8, vLLM's fp8; compressed-tensors' float schemes).

A weight is float8_e4m3fn [N, K] with float32 scales: one per 128 x 128 block (`weight_scale_inv`
[ceil(N/128), ceil(K/128)], DeepSeek's naming: it multiplies), one per tensor or one per output row
(`weight_scale`). The dense weight is `w[n, k] = float32(q[n, k]) * scale[n // 128, k // 128]`, exactly as
transformers' `Fp8Dequantize` and DeepSeek's `weight_dequant` define it, rounded once to the activation dtype.

What is computed (W8A16, weight-only, as vLLM does for fp8 on the CPU): the weight stays fp8 in memory (1 byte a
weight, plus float32 scales: 4 bytes per row and 128 columns). On the CPU, llmplug's kernel `fp8_matmul`
(layers/kernels/native/fp8.cpp) decodes each weight in registers, scales it and rounds it to the activation dtype
exactly as above, and sums in float32 in a fixed order, reading half the bytes of a bf16 weight (its speed against
the dense model: docs/quantization.md). Elsewhere (a GPU tensor, no C++ compiler) each call dequantizes
the weight about a million weights (whole 128-row blocks) at a time into the activation dtype, exactly as above, and
multiplies that tile with F.linear (torch has no fast fp8 GEMM on the CPU: `torch._scaled_mm` runs there ~50x slower
than bf16). Activations are not quantized: an `input_scale` (activation_scheme static) is read and checked but not
applied, as transformers' CPU load of the same checkpoint (which dequantizes the whole model) does not apply it either.

Batch invariance: the kernel computes every output row by the same instructions whatever the number of rows (by
construction). On the tile path the dequantized tile does not depend on x, and in batch-invariant mode each tile's
F.linear is called by its row plan (layers/row_invariance.py), probed per tile shape when the layer is loaded; where
no plan holds, the layer says so once (a warning) and declares `row_invariant` False.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from llmplug.core.errors import ModelLoadError
from llmplug.layers.kernels.native import ops, use_native
from llmplug.layers.packed_linear import row_plan_for
from llmplug.layers.row_invariance import RowPlan
from llmplug.quantization.base import QuantizationConfig, QuantizedExpertsMethod, QuantizedLinearMethod

if TYPE_CHECKING:
    from llmplug.layers.linear import LinearBase
    from llmplug.layers.moe.experts import FusedExperts
    from llmplug.layers.quantization import LinearOptions

__all__ = [
    "BLOCK", "Fp8Config", "Fp8LinearMethod", "Fp8Scheme", "compressed_tensors_fp8_method", "dequantize_tile",
    "tile_rows",
]

log = logging.getLogger(__name__)

BLOCK = 128  # the only block size implemented: [128, 128] (DeepSeek V3, Qwen3-FP8)
# elements of the weight dequantized per step of a call: few enough torch ops per layer (each costs a parallel
# region's start-up), a temporary (4 bytes an element) that stays in L2-L3
TILE_ELEMENTS = 1 << 20
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # all exact in float32
# a fused layer's checkpoint modules, to match ignored_layers that name them (vLLM's packed_modules_mapping)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How a checkpoint stores an fp8 layer.

    scale_name: the checkpoint tensor of the weight scales; blocked: scales per 128 x 128 block (else one per
    output row or one per tensor, the checkpoint's shape says which); input_scale: the layer also has a static
    activation scale (`input_scale`, read, not applied).
    """

    scale_name: str
    blocked: bool
    input_scale: bool = False


class Fp8LinearMethod(QuantizedLinearMethod):
    """A layer of an fp8 checkpoint: fp8 weight [N, K] in memory, multiplied by `fp8_matmul` on the CPU (else
    dequantized a tile of rows at a time per call).

    Per-layer state lives on the layer (`weight`, the scale parameter, `fp8_plans`), so one method may serve several
    layers of one dtype.
    """

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme
        self.dtype = torch.get_default_dtype()  # the model's: layers are built inside the loader's dtype context
        self._row_invariant = True

    @property
    def row_invariant(self) -> bool:  # type: ignore[override]
        """Rows never depend on their number on the CPU kernel (by construction); on the tile path, where
        batch-invariant mode found a row plan for every tile shape when the layer was loaded."""
        return self._row_invariant

    # ------------------------------------------------------------ loading

    def create_weights(self, layer: LinearBase) -> None:
        rank, ranks = layer.input_split
        if self.scheme.blocked and ranks > 1 and layer.input_size % BLOCK:
            raise ModelLoadError(
                f"{layer.prefix}: tensor parallelism splits its {layer.input_size * ranks} input features into "
                f"{ranks} parts of {layer.input_size}, which cuts the checkpoint's {BLOCK}-column fp8 scale blocks; "
                "choose a tensor_parallel_size that keeps them whole"
            )
        weight = layer.create_parameter("weight", (layer.output_size, layer.input_size), torch.float8_e4m3fn, 0, 1)
        weight.weight_loader = _checked(layer, "weight", weight.weight_loader, _weight_check)
        # scales are kept per output row ([N, column blocks], float32): a fused or sharded layer's rows then need
        # no block alignment, at 4 bytes per row and 128 columns (3% of the fp8 weight)
        columns = math.ceil(layer.input_size / BLOCK) if self.scheme.blocked else 1
        scale = layer.create_parameter(self.scheme.scale_name, (layer.output_size, columns), torch.float32, 0,
                                       1 if self.scheme.blocked else None)
        scale.weight_loader = _scale_loader(layer, self.scheme, scale.weight_loader)
        if self.scheme.input_scale:
            layer.register_parameter("input_scale", _input_scale_parameter(layer))

    def process_weights_after_loading(self, layer: LinearBase, options: LinearOptions) -> None:
        """Check the loaded tensors; off the kernel, probe the tiles' row plans in batch-invariant mode."""
        scale = getattr(layer, self.scheme.scale_name).data
        name = f"{layer.prefix}.{self.scheme.scale_name}"
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise ModelLoadError(f"{name} has negative, infinite or NaN scales; the checkpoint is damaged")
        codes = layer.weight.data.view(torch.uint8)
        if bool(((codes & 0x7F) == 0x7F).any()):  # e4m3fn's only NaN codes
            raise ModelLoadError(f"{layer.prefix}.weight holds fp8 NaNs; the checkpoint is damaged")
        layer.fp8_plans, layer.fp8_row_variant = {}, False
        layer.fp8_row_invariant = options.row_invariant
        if not use_native(layer.weight):  # the tile path: its tile shapes' plans now, for the engine's check
            step = tile_rows(layer.input_size)
            for start in range(0, layer.output_size, step):
                _plan(layer, min(step, layer.output_size - start), self.dtype)
            self._row_invariant &= options.row_invariant and not layer.fp8_row_variant

    # ------------------------------------------------------------ computing

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [M, K]
        scale = getattr(layer, self.scheme.scale_name)  # [N, column blocks or 1]
        if use_native(rows):
            y = ops().fp8_matmul(rows, layer.weight, scale)  # [M, N]
        else:
            y = self._tiles(layer, rows, scale)
        if bias is not None:
            y += bias
        return y.view(*x.shape[:-1], layer.output_size)

    def _tiles(self, layer: LinearBase, rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The tile path: [M, K] -> [M, N], a tile of whole 128-row blocks dequantized at a time."""
        step = tile_rows(layer.input_size)
        parts = []
        for start in range(0, layer.output_size, step):
            stop = min(start + step, layer.output_size)
            tile = dequantize_tile(layer.weight[start:stop], scale[start:stop] * 256.0, 0, stop - start,
                                   self.scheme.blocked, rows.dtype)
            plan = _plan(layer, stop - start, rows.dtype)
            parts.append(F.linear(rows, tile) if plan is None else plan(lambda part: F.linear(part, tile), rows))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        scale = getattr(layer, self.scheme.scale_name).data * 256.0
        return dequantize_tile(layer.weight, scale, 0, layer.output_size, self.scheme.blocked, torch.float32)

    def __repr__(self) -> str:
        scales = "128x128 blocks" if self.scheme.blocked else "per-row/tensor scale"
        return f"fp8(w8a16, {scales})"


def tile_rows(in_features: int) -> int:
    """Output rows dequantized per step: whole 128-row blocks, about TILE_ELEMENTS weights."""
    return max(1, TILE_ELEMENTS // in_features // BLOCK) * BLOCK


def dequantize_tile(
    weight: torch.Tensor, scale: torch.Tensor, start: int, stop: int, blocked: bool, dtype: torch.dtype
) -> torch.Tensor:
    """Rows start:stop of the dense weight, float32(q) * scale rounded once to `dtype`; `scale`: [N, C] float32
    times 2^8 (per row and 128 columns when `blocked`, else [N, 1])."""
    # float16 -> float32 is exact; then the products in place (torch's mixed float16 * float32 loop is ~2x slower)
    tile = _decode_tile(weight[start:stop]).float()  # [T, K]: value / 2^8
    scale = scale[start:stop]
    rows, columns = tile.shape
    whole = columns // BLOCK * BLOCK
    if not blocked:
        tile.mul_(scale)
    else:
        tile[:, :whole].view(rows, -1, BLOCK).mul_(scale[:, : whole // BLOCK, None])  # [T, K / 128, 128]
        if whole < columns:  # a last, narrower column block
            tile[:, whole:].mul_(scale[:, -1:])
    return tile if dtype == torch.float32 else tile.to(dtype)


def _decode_tile(q: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3fn [T, K] -> float16 values / 2^8, exactly.

    torch converts fp8 on the CPU one element at a time (~4x slower than this). e4m3fn's bits placed in a float16
    (sign to the sign bit, exponent and mantissa shifted by 7) are the same number times 2^-8 (biases 7 and 15),
    subnormals included; the vectorized float16 -> float32 conversion is exact, and 2^8 is folded into the scales.
    (e4m3fn's NaN codes would decode to 480: the loader refuses them.)
    """
    bits = q.view(torch.int8).to(torch.int16)  # sign-extended: a negative code has bits 15..7 set
    bits <<= 7
    bits &= -16385  # clear bit 14 (0xBFFF): the sign stays in bit 15, the 4 exponent bits land in 13..10
    return bits.view(torch.float16)


def _plan(layer: LinearBase, rows: int, dtype: torch.dtype) -> RowPlan | None:
    """The row plan of a [rows, K] tile's F.linear in batch-invariant mode (None: one plain call)."""
    if not getattr(layer, "fp8_row_invariant", False):
        return None
    key = (rows, dtype)
    if key not in layer.fp8_plans:
        plan = row_plan_for("torch F.linear", rows, layer.input_size, dtype, torch.get_num_threads())
        if plan is None:
            log.warning("%s: F.linear on [%d x %d] %s tiles sums rows in an order that depends on their number here; "
                        "its results are not batch invariant", layer.prefix, rows, layer.input_size, dtype)
            layer.fp8_row_variant = True
        layer.fp8_plans[key] = None if plan in (None, RowPlan()) else plan
    return layer.fp8_plans[key]


# ---------------------------------------------------------------- loaders with the checkpoint's shapes checked


def _checked(layer: LinearBase, name: str, load: Any, check: Any) -> Any:
    def checked_load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        check(f"{layer.prefix}.{name}", loaded)
        load(param, loaded, shard_id)

    return checked_load


def _weight_check(name: str, loaded: torch.Tensor) -> None:
    if loaded.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(
            f"{name} is {loaded.dtype} in the checkpoint; an fp8 layer's weight is torch.float8_e4m3fn"
        )


def _full_rows(layer: LinearBase, shard_id: Any) -> int:
    """The checkpoint tensor's rows for `shard_id` (this rank takes a slice of them)."""
    _, size, _, count = layer._output_slot(shard_id)
    return size * count


def _scale_loader(layer: LinearBase, scheme: Fp8Scheme, load: Any) -> Any:
    """Checks the checkpoint's scale (dtype, shape) and expands it to one row per output feature before placing."""
    name = f"{layer.prefix}.{scheme.scale_name}"
    columns = layer.input_size * layer.input_split[1]

    def load_scale(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.dtype not in _SCALE_DTYPES:
            raise ModelLoadError(f"{name} is {loaded.dtype} in the checkpoint; fp8 scales are float32 (or bf16/fp16)")
        rows = _full_rows(layer, shard_id)
        if scheme.blocked:
            expected = (math.ceil(rows / BLOCK), math.ceil(columns / BLOCK))
            if tuple(loaded.shape) != expected:
                raise ModelLoadError(f"{name} has shape {tuple(loaded.shape)}; a [{rows} x {columns}] weight in "
                                     f"{BLOCK}x{BLOCK} blocks has {list(expected)} block scales")
            per_row = loaded.float().repeat_interleave(BLOCK, 0)[:rows]  # [rows, column blocks]
        elif loaded.numel() == 1:  # per tensor
            per_row = loaded.float().reshape(1, 1).expand(rows, 1)
        elif loaded.numel() == rows and loaded.dim() <= 2 and loaded.shape[0] == rows:  # per output row
            per_row = loaded.float().reshape(rows, 1)
        else:
            raise ModelLoadError(f"{name} has shape {tuple(loaded.shape)}; a weight of {rows} rows takes one scale "
                                 f"per tensor ([] or [1]) or per row ([{rows}, 1])")
        load(param, per_row.contiguous(), shard_id)

    return load_scale


def static_input_scale(name: str, loaded: torch.Tensor) -> float:
    """A checkpoint's static activation scale `name`: one positive, finite float (ModelLoadError naming it)."""
    if loaded.dtype not in _SCALE_DTYPES or loaded.numel() != 1:
        raise ModelLoadError(f"{name} is {loaded.dtype} of shape {tuple(loaded.shape)}; a static activation "
                             "scale is one float32")
    value = float(loaded)
    if not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{name} is {value}; a static activation scale is a positive number")
    return value


def _input_scale_parameter(layer: LinearBase) -> torch.nn.Parameter:
    """The static activation scale: one per checkpoint tensor; a fused layer keeps the largest (as vLLM does)."""
    name = f"{layer.prefix}.input_scale"

    def load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        param.data.fill_(max(static_input_scale(name, loaded), float(param.data)))

    param = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    param.weight_loader = load
    return param


# ---------------------------------------------------------------- the checkpoint's settings


def _refuse(setting: str, value: Any, supported: str) -> ModelLoadError:
    return ModelLoadError(f"fp8 checkpoint: quantization_config.{setting}={value!r} is not implemented; {supported}")


class Fp8Config(QuantizationConfig):
    """quant_method "fp8": e4m3 weights with 128x128 block scales (`weight_scale_inv`) or a per-tensor
    `weight_scale`; activation_scheme dynamic or static; ignored_layers / modules_to_not_convert stay dense."""

    name = "fp8"

    def __init__(self, blocked: bool, static_activations: bool, ignored: tuple[str, ...]) -> None:
        self.scheme = Fp8Scheme("weight_scale_inv" if blocked else "weight_scale", blocked, static_activations)
        self.ignored = ignored

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _refuse("fmt", fmt, "fp8 weights are e4m3 (float8_e4m3fn)")
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse("activation_scheme", scheme, "it is dynamic or static")
        block = config.get("weight_block_size")
        if block is not None and list(block) != [BLOCK, BLOCK]:
            raise _refuse("weight_block_size", block, f"blocks are [{BLOCK}, {BLOCK}] (or none: a per-tensor scale)")
        if block is not None and scheme == "static":
            raise _refuse("activation_scheme", scheme, "block-scaled fp8 checkpoints have dynamic activations")
        for setting in ("kv_cache_scheme", "weight_scale_ue8m0"):
            if config.get(setting):
                raise _refuse(setting, config[setting], "leave it unset")
        ignored = [*(config.get("ignored_layers") or ()), *(config.get("modules_to_not_convert") or ())]
        return cls(block is not None, scheme == "static", tuple(ignored))

    def linear_method(self, layer: LinearBase, prefix: str) -> QuantizedLinearMethod | None:
        return None if _skipped(prefix, self.ignored) else Fp8LinearMethod(self.scheme)

    def experts_method(self, experts: FusedExperts, prefix: str) -> QuantizedExpertsMethod | None:
        """The routed experts: llmplug.quantization.fp8_experts (block or per-tensor scales)."""
        from llmplug.quantization.fp8_experts import Fp8ExpertsMethod  # it imports this module

        return Fp8ExpertsMethod(self.scheme)


def _skipped(prefix: str, ignored: tuple[str, ...]) -> bool:
    """Whether the layer named `prefix` (a fused layer: its checkpoint modules) is among `ignored` (module names,
    whole or a trailing dotted path such as "lm_head"); a fused layer cannot be part dense."""
    parent, _, leaf = prefix.rpartition(".")
    names = [f"{parent}.{part}" if parent else part for part in _FUSED.get(leaf, (leaf,))]
    matches = [any(name == entry or name.endswith("." + entry) for entry in ignored) for name in names]
    if any(matches) and not all(matches):
        raise ModelLoadError(f"{prefix} fuses {names}, of which the fp8 checkpoint leaves only some unquantized; "
                             "a fused layer is quantized whole or not at all")
    return all(matches) if ignored else False


def compressed_tensors_fp8_method(
    weights_args: dict[str, Any], input_args: dict[str, Any] | None
) -> QuantizedLinearMethod:
    """The method of a compressed-tensors `float-quantized` scheme: 8-bit float weights with a `weight_scale` per
    tensor, per channel or per 128x128 block; activations (`input_args`) dynamic or static (`input_scale`), not
    applied (weight-only, see the module doc). ModelLoadError naming any other setting."""
    def need(setting: str, value: Any, allowed: tuple[Any, ...]) -> None:
        if value not in allowed:
            raise ModelLoadError(f"compressed-tensors fp8 scheme: weights.{setting}={value!r} is not implemented; "
                                 f"supported: {', '.join(map(repr, allowed))}")

    need("num_bits", weights_args.get("num_bits"), (8,))
    need("type", weights_args.get("type"), ("float",))
    need("symmetric", weights_args.get("symmetric", True), (True,))
    need("dynamic", weights_args.get("dynamic", False), (False,))
    strategy = weights_args.get("strategy")
    need("strategy", strategy, ("tensor", "channel", "block"))
    if strategy == "block":
        need("block_structure", list(weights_args.get("block_structure") or ()), ([BLOCK, BLOCK],))
    static = False
    if input_args is not None:
        for setting, allowed in (("num_bits", (8,)), ("type", ("float",)), ("strategy", ("tensor", "token", "group"))):
            if input_args.get(setting) not in allowed:
                raise ModelLoadError(f"compressed-tensors fp8 scheme: input_activations.{setting}="
                                     f"{input_args.get(setting)!r} is not implemented; supported: {allowed}")
        static = not input_args.get("dynamic", True)
        if static and input_args.get("strategy") != "tensor":
            raise ModelLoadError("compressed-tensors fp8 scheme: static input activations are implemented per tensor "
                                 f"only, not {input_args.get('strategy')!r}")
    return Fp8LinearMethod(Fp8Scheme("weight_scale", strategy == "block", static))
