"""compressed-tensors checkpoints (llm-compressor): quant_method "compressed-tensors".

config.json's `config_groups` give each group of linear layers (`targets`: "Linear", a module name, or "re:" a
regex; minus `ignore`) a scheme, stored in the group's (or the config's) format:

- pack-quantized (W4A16, W8A16): weight_packed int32 [N, K * bits / 32] (values + 2^(bits-1), lowest bits first,
  packed along K), weight_scale [N, G] (group or channel), weight_zero_point int32 [N * bits / 32, G] (asymmetric;
  packed along N), weight_shape [2]: w = (q - z) * s, computed by the int4 kernel (int_weights.py);
- int-quantized / naive-quantized: weight int8 [N, K] (signed), weight_scale; with int8 input activations (W8A8:
  dynamic per token, or a static input_scale) it computes in int8 (`torch._int_mm`, exact int32 sums), weight-only
  it takes the int4 kernel's two planes; the int8 weight is all it ever holds;
- float-quantized (FP8): llmplug.quantization.fp8's `compressed_tensors_fp8_method`;
- dense: the layer stays dense.

A fused layer (qkv_proj, gate_up_proj) is quantized when its checkpoint projections are, all alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from llmplug.core.errors import ModelLoadError
from llmplug.layers.int8_linear import int8_matmul_exact
from llmplug.quantization.base import (
    QuantizationConfig,
    QuantizedExpertsMethod,
    QuantizedLinearMethod,
    refuse_experts,
)
from llmplug.quantization.int_weights import (
    IntWeights,
    IntWeightsMethod,
    float_loader,
    free_checkpoint_tensors,
    unpack_int32,
)

if TYPE_CHECKING:
    from llmplug.layers.linear import LinearBase
    from llmplug.layers.moe.experts import FusedExperts
    from llmplug.layers.quantization import LinearOptions

__all__ = ["CTInt8Method", "CTIntWeightsMethod", "CompressedTensorsConfig"]

# the checkpoint projections of llmplug's fused layers (as vLLM's packed_modules_mapping)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # each routed expert's, in the checkpoint
_INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_SUPPORTED_FORMATS = (*_INT_FORMATS, "float-quantized", "dense")
_REFUSED_SETTINGS = ("kv_cache_scheme", "sparsity_config", "transform_config")


@dataclass(frozen=True, slots=True, eq=False)  # one per config group: compared by identity
class _Scheme:
    """One config group: which layers, in which format, with which weight and input-activation arguments."""

    targets: tuple[str, ...]
    fmt: str
    weights: dict[str, Any] | None
    inputs: dict[str, Any] | None

    def matches(self, name: str) -> bool:
        return any(_matches(name, target) for target in self.targets)


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' matching of a linear layer's checkpoint name against a target or ignore entry."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == "Linear" or name == target


class CTIntWeightsMethod(IntWeightsMethod):
    """A weight-only integer layer (pack-quantized, or int-quantized without activations) through the int4 kernel."""

    def __init__(self, weights: dict[str, Any], packed: bool) -> None:
        super().__init__()
        self.bits, self.packed = weights["num_bits"], packed
        self.symmetric = weights.get("symmetric", True)
        self.group_size = weights.get("group_size") if weights.get("strategy") == "group" else None

    @property
    def checkpoint_tensors(self) -> tuple[str, ...]:
        names = ("weight_packed", "weight_shape") if self.packed else ("weight",)
        return (*names, "weight_scale") + (() if self.symmetric else ("weight_zero_point",))

    def create_weights(self, layer: LinearBase) -> None:
        n, k = layer.output_size, layer.input_size
        if self.group_size is not None and k % self.group_size:
            raise ModelLoadError(f"{layer.prefix}: this rank's {k} inputs do not split into groups of "
                                 f"{self.group_size}")
        groups, group_dim = (k // self.group_size, 1) if self.group_size is not None else (1, None)
        pack = 32 // self.bits
        if self.packed:
            layer.create_parameter("weight_packed", (n, k // pack), torch.int32, output_dim=0, input_dim=1)
            _shape_checker(layer, layer.create_parameter("weight_shape", (2,), torch.int64, None, None))
        else:
            layer.create_parameter("weight", (n, k), torch.int8, output_dim=0, input_dim=1)
        scale = layer.create_parameter("weight_scale", (n, groups), torch.float32, output_dim=0, input_dim=group_dim)
        float_loader(scale)
        if not self.symmetric:
            zero_shape, zero_pack = ((n // pack, groups), pack) if self.packed else ((n, groups), 1)
            layer.create_parameter("weight_zero_point", zero_shape, torch.int32 if self.packed else torch.int8,
                                   output_dim=0, input_dim=group_dim, output_pack=zero_pack)

    def int_weights(self, layer: LinearBase) -> IntWeights:
        offset = 2 ** (self.bits - 1)  # stored values are signed: q - offset
        if self.packed:
            q = unpack_int32(layer.weight_packed, self.bits, dim=1)
        else:
            q = layer.weight.to(torch.int32) + offset
        scale = layer.weight_scale
        if self.symmetric:
            zero = torch.full_like(scale, offset)
        elif self.packed:
            zero = unpack_int32(layer.weight_zero_point, self.bits, dim=0).float()
        else:
            zero = layer.weight_zero_point.float() + offset
        return IntWeights(q.contiguous(), scale.contiguous(), zero, self.bits)


class CTInt8Method(QuantizedLinearMethod):
    """W8A8: int8 weight rows with a scale each, x quantized to int8 per token (or with a static scale) as
    compressed-tensors does (symmetric, scale = max |x| / 127.5, clamped to -128..127), int32 sums."""

    def __init__(self, static_input: bool) -> None:
        self.static_input = static_input
        self.weight_t: torch.Tensor | None = None  # [K, N] int8 view of [N, K] rows

    def create_weights(self, layer: LinearBase) -> None:
        n, k = layer.output_size, layer.input_size
        layer.create_parameter("weight", (n, k), torch.int8, output_dim=0, input_dim=1)
        float_loader(layer.create_parameter("weight_scale", (n, 1), torch.float32, output_dim=0, input_dim=None))
        if self.static_input:
            _largest_of_shards(float_loader(layer.create_parameter("input_scale", (1,), torch.float32, None, None)))

    def process_weights_after_loading(self, layer: LinearBase, options: LinearOptions) -> None:
        if not int8_matmul_exact(layer.weight_scale.device.type):
            raise ModelLoadError(f"{layer.prefix}: int8 W8A8 needs an exact int8 matmul (torch._int_mm) here")
        self.weight_t = layer.weight.data.t()
        self.scale = layer.weight_scale.data.reshape(1, -1)  # [1, N]
        self.input_scale = layer.input_scale.data if self.static_input else None
        free_checkpoint_tensors(layer, ("weight", "weight_scale", "input_scale"))

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()  # [M, K]
        scale = rows.abs().amax(-1, keepdim=True).div_(127.5) if self.input_scale is None else self.input_scale
        q = rows.div(scale.clamp(min=1e-30)).round_().clamp_(-128, 127).to(torch.int8)
        y = torch._int_mm(q, self.weight_t).float().mul_(scale).mul_(self.scale)  # [M, N]
        if bias is not None:
            y += bias
        return y.to(x.dtype).view(*x.shape[:-1], -1)

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        if self.weight_t is None:
            return layer.weight.float() * layer.weight_scale
        return self.weight_t.t().float() * self.scale.t()

    def __repr__(self) -> str:
        return f"int8(w8a8, {'static' if self.static_input else 'per-token'} activations)"


class CompressedTensorsConfig(QuantizationConfig):
    """A compressed-tensors checkpoint's config groups and ignore list."""

    name = "compressed-tensors"

    def __init__(self, schemes: tuple[_Scheme, ...], ignore: tuple[str, ...]) -> None:
        self.schemes, self.ignore = schemes, ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        for setting in _REFUSED_SETTINGS:
            if config.get(setting):
                raise ModelLoadError(f"compressed-tensors {setting} is not implemented by llmplug ({config[setting]})")
        groups = config.get("config_groups") or {}
        if not groups:
            raise ModelLoadError("a compressed-tensors quantization_config without config_groups")
        schemes = tuple(_scheme(name, group, config.get("format")) for name, group in groups.items())
        return cls(schemes, tuple(config.get("ignore") or ()))

    def linear_method(self, layer: LinearBase, prefix: str) -> QuantizedLinearMethod | None:
        owner, _, leaf = prefix.rpartition(".")
        names = [f"{owner}.{part}" if owner else part for part in FUSED.get(leaf, (leaf,))]
        schemes = {self._scheme_of(name) for name in names}
        if len(schemes) > 1:
            raise ModelLoadError(f"{prefix} fuses {names}, which the checkpoint quantizes differently")
        scheme = schemes.pop()
        return None if scheme is None else _method(scheme)

    def experts_method(self, experts: FusedExperts, prefix: str) -> QuantizedExpertsMethod | None:
        """The routed experts (their checkpoint projections `<prefix>.<e>.gate_proj`, ...) in one scheme: dense,
        weight-only pack-quantized (llmplug.quantization.int_experts) or float-quantized FP8
        (llmplug.quantization.fp8_experts); any other scheme is refused by name."""
        names = [f"{prefix}.{e}.{part}" for e in range(experts.num_experts) for part in EXPERT_PROJECTIONS]
        schemes = {self._scheme_of(name) for name in names}
        if len(schemes) > 1:
            raise ModelLoadError(f"{prefix}: the checkpoint quantizes its experts' projections differently")
        scheme = schemes.pop()
        if scheme is None or scheme.fmt == "dense" or scheme.weights is None:
            return None
        if scheme.fmt == "float-quantized":  # FP8: the fp8 checkpoints' experts method, on this scheme
            from llmplug.quantization.fp8_experts import Fp8ExpertsMethod

            return Fp8ExpertsMethod(_fp8_method(scheme).scheme)  # type: ignore[attr-defined]
        if scheme.fmt != "pack-quantized" or scheme.inputs is not None:
            raise refuse_experts(f"compressed-tensors {scheme.fmt}"
                                 + (" with quantized input activations" if scheme.inputs is not None else ""), prefix)
        from llmplug.quantization.int_experts import CTPackedExpertsMethod

        return CTPackedExpertsMethod(scheme.weights)

    def _scheme_of(self, name: str) -> _Scheme | None:
        if any(_matches(name, entry) and entry != "Linear" for entry in self.ignore):
            return None
        return next((s for s in self.schemes if s.matches(name)), None)


def _scheme(name: str, group: dict[str, Any], default_format: str | None) -> _Scheme:
    """One config group, checked for what llmplug implements (a ModelLoadError naming the setting otherwise)."""
    fmt = group.get("format") or default_format or "dense"
    if fmt not in _SUPPORTED_FORMATS:
        raise ModelLoadError(f"compressed-tensors format {fmt!r} ({name}) is not implemented by llmplug "
                             f"(it reads {', '.join(_SUPPORTED_FORMATS)})")
    if group.get("output_activations"):
        raise ModelLoadError(f"compressed-tensors output_activations ({name}) are not implemented by llmplug")
    scheme = _Scheme(tuple(group.get("targets") or ()), fmt, group.get("weights"), group.get("input_activations"))
    if fmt in _INT_FORMATS:
        _check_int(name, scheme)
    return scheme


def _check_int(name: str, scheme: _Scheme) -> None:
    weights, inputs = scheme.weights or {}, scheme.inputs
    where = f"compressed-tensors {name} ({scheme.fmt})"
    _require(where, "weights.type", weights.get("type"), ("int",))
    _require(where, "weights.num_bits", weights.get("num_bits"), (4, 8) if scheme.fmt == "pack-quantized" else (8,))
    _require(where, "weights.strategy", weights.get("strategy"), ("group", "channel"))
    _require(where, "weights.actorder", weights.get("actorder"), (None,))
    _require(where, "weights.dynamic", weights.get("dynamic", False), (False,))
    if inputs is not None:
        _require(where, "input_activations.type", inputs.get("type"), ("int",))
        _require(where, "input_activations.num_bits", inputs.get("num_bits"), (8,))
        _require(where, "input_activations.symmetric", inputs.get("symmetric", True), (True,))
        _require(where, "weights.symmetric", weights.get("symmetric", True), (True,))
        _require(where, "weights.strategy", weights.get("strategy"), ("channel",))
        dynamic = inputs.get("dynamic", False)
        _require(where, "input_activations.strategy", inputs.get("strategy"), ("token",) if dynamic else ("tensor",))
        if scheme.fmt == "pack-quantized":
            raise ModelLoadError(f"{where}: pack-quantized with int8 input activations is not implemented by llmplug")


def _require(where: str, setting: str, value: object, readable: tuple[object, ...]) -> None:
    if value not in readable:
        raise ModelLoadError(f"{where}: {setting}={value!r} is not implemented by llmplug (it reads {list(readable)})")


def _method(scheme: _Scheme) -> QuantizedLinearMethod | None:
    """The layer method of a (checked) scheme; None for dense."""
    if scheme.fmt == "dense" or scheme.weights is None:
        return None
    if scheme.fmt == "float-quantized":
        return _fp8_method(scheme)
    if scheme.inputs is not None:
        return CTInt8Method(static_input=not scheme.inputs.get("dynamic", False))
    return CTIntWeightsMethod(scheme.weights, packed=scheme.fmt == "pack-quantized")


def _fp8_method(scheme: _Scheme) -> QuantizedLinearMethod:
    """compressed-tensors FP8 layers: another module's method (llmplug.quantization.fp8)."""
    try:
        from llmplug.quantization.fp8 import compressed_tensors_fp8_method
    except ImportError as error:
        raise ModelLoadError(f"compressed-tensors float-quantized (FP8) needs llmplug.quantization.fp8's "
                             f"compressed_tensors_fp8_method, which is not available: {error}") from error
    return compressed_tensors_fp8_method(scheme.weights, scheme.inputs)


def _shape_checker(layer: LinearBase, param: nn.Parameter) -> None:
    """weight_shape ([out, in] of the whole checkpoint projection): checked against the layer's inputs, not kept."""
    total_inputs = layer.input_size * layer.input_split[1]

    def check(target: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.numel() != 2 or int(loaded.reshape(-1)[1]) != total_inputs:
            raise ModelLoadError(f"weight_shape {loaded.tolist()} does not match the layer's {total_inputs} inputs")
        target.data.copy_(loaded.reshape(-1).to(target.dtype))

    param.weight_loader = check  # type: ignore[attr-defined]


def _largest_of_shards(param: nn.Parameter) -> None:
    """A fused layer's static input scale: the largest of its projections' (they quantize the same input)."""
    load: Callable[..., None] = param.weight_loader  # type: ignore[attr-defined]
    seen: list[float] = []

    def keep_largest(target: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        load(target, loaded.reshape(target.shape))
        seen.append(float(target))
        target.data.fill_(max(seen))

    param.weight_loader = keep_largest  # type: ignore[attr-defined]
