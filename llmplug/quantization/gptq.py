"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): quant_method "gptq", 4- and 8-bit integer groups.

A quantized linear layer's tensors (K inputs, N outputs, pack = 32 / bits values per int32):
qweight int32 [K / pack, N] (packed along K, lowest bits first), qzeros int32 [G, N / pack] (packed along N),
scales float16 [G, N], g_idx int32 [K] (each input's group; act-order when desc_act). w = (q - z) * s, where the
original format (v1) stores z - 1 and "gptq_v2" (GPTQModel) stores z. Layers the config leaves out
(`modules_to_not_convert`, a negative `dynamic` rule) are dense.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch

from llmplug.core.errors import ModelLoadError
from llmplug.quantization.base import QuantizationConfig, QuantizedExpertsMethod
from llmplug.quantization.int_weights import IntWeights, IntWeightsMethod, float_loader, unpack_int32

if TYPE_CHECKING:
    from llmplug.layers.linear import LinearBase
    from llmplug.layers.moe.experts import FusedExperts

__all__ = ["GPTQConfig", "GPTQLinearMethod"]

_BITS = (4, 8)
_GROUP_SIZES = (32, 64, 128, -1)
_FORMATS = ("gptq", "gptq_v2")
# options whose other values change what the tensors mean: (setting, the values llmplug reads)
_REFUSED_UNLESS = (("is_marlin_format", (None, False)), ("lm_head", (None, False)), ("pack_dtype", (None, "int32")))


class GPTQLinearMethod(IntWeightsMethod):
    """One GPTQ layer: the checkpoint's qweight / qzeros / scales / g_idx, repacked for the int4 kernel."""

    checkpoint_tensors = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, bits: int, group_size: int, desc_act: bool, zero_offset: int) -> None:
        super().__init__()
        self.bits, self.group_size, self.desc_act, self.zero_offset = bits, group_size, desc_act, zero_offset
        self.first_group = 0

    def create_weights(self, layer: LinearBase) -> None:
        pack = 32 // self.bits
        k, n = layer.input_size, layer.output_size
        _check_divides(layer, k, pack, "input features")
        _check_divides(layer, n, pack, "output features")
        # groups cut by the input split: whole scales when act-order scatters them, or for one group per row
        rank_groups = self.group_size != -1 and not (self.desc_act and layer.input_split[1] > 1)
        if rank_groups:
            _check_divides(layer, k, self.group_size, "input features")
        groups = k // self.group_size if rank_groups else _total_groups(layer, self.group_size)
        # g_idx counts groups from the first input of the whole layer: this rank's first group, when it has its own
        self.first_group = layer.input_split[0] * groups if rank_groups else 0
        group_dim = 0 if rank_groups else None
        layer.create_parameter("qweight", (k // pack, n), torch.int32, output_dim=1, input_dim=0)
        layer.create_parameter("qzeros", (groups, n // pack), torch.int32, output_dim=1, input_dim=group_dim,
                               output_pack=pack)
        float_loader(layer.create_parameter("scales", (groups, n), torch.float32, output_dim=1, input_dim=group_dim))
        _shared_by_shards(layer.create_parameter("g_idx", (k,), torch.int32, output_dim=None, input_dim=0))

    def int_weights(self, layer: LinearBase) -> IntWeights:
        q = unpack_int32(layer.qweight, self.bits, dim=0).t()  # [N, K]
        zero = unpack_int32(layer.qzeros, self.bits, dim=1).t().float() + self.zero_offset  # [N, G]
        g_idx = layer.g_idx.long() - self.first_group
        if bool((g_idx < 0).any()) or bool((g_idx >= zero.shape[1]).any()):
            raise ModelLoadError(f"{layer.prefix}.g_idx holds groups outside 0..{zero.shape[1] - 1}")
        return IntWeights(q.contiguous(), layer.scales.t().contiguous(), zero, self.bits, g_idx)


class GPTQConfig(QuantizationConfig):
    """A GPTQ checkpoint's settings."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, v2: bool, excluded: tuple[str, ...],
                 dynamic: dict[str, Any]) -> None:
        self.bits, self.group_size, self.desc_act, self.v2 = bits, group_size, desc_act, v2
        self.excluded, self.dynamic = excluded, dynamic

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GPTQConfig:
        bits, group_size = config.get("bits"), config.get("group_size", -1)
        if bits not in _BITS:
            raise ModelLoadError(f"GPTQ bits={bits!r} is not implemented (llmplug reads bits {_BITS})")
        if group_size not in _GROUP_SIZES:
            raise ModelLoadError(f"GPTQ group_size={group_size!r} is not implemented (llmplug reads {_GROUP_SIZES})")
        fmt = config.get("checkpoint_format", config.get("format", "gptq"))
        if fmt not in _FORMATS:
            raise ModelLoadError(f"GPTQ checkpoint_format={fmt!r} is not implemented (llmplug reads {_FORMATS})")
        for setting, readable in _REFUSED_UNLESS:
            if config.get(setting) not in readable:
                raise ModelLoadError(f"GPTQ {setting}={config[setting]!r} is not implemented by llmplug's gptq method")
        dynamic = config.get("dynamic") or {}
        if any(not key.startswith("-:") for key in dynamic):
            raise ModelLoadError(f"GPTQ dynamic rules {sorted(dynamic)}: only exclusions ('-:regex') are implemented")
        excluded = tuple(config.get("modules_to_not_convert") or ())
        return cls(bits, group_size, bool(config.get("desc_act", False)), fmt == "gptq_v2", excluded, dynamic)

    def linear_method(self, layer: LinearBase, prefix: str) -> GPTQLinearMethod | None:
        if self._dense(prefix):
            return None
        return GPTQLinearMethod(self.bits, self.group_size, self.desc_act, 0 if self.v2 else 1)

    def experts_method(self, experts: FusedExperts, prefix: str) -> QuantizedExpertsMethod | None:
        """The routed experts: llmplug.quantization.int_experts."""
        if self._dense(f"{prefix}.0.gate_proj"):
            return None
        from llmplug.quantization.int_experts import GPTQExpertsMethod

        return GPTQExpertsMethod(self.bits, self.group_size, 0 if self.v2 else 1, self.desc_act)

    def _dense(self, prefix: str) -> bool:
        """Whether the checkpoint keeps layer `prefix` unquantized."""
        parts = prefix.split(".")
        if any(name in parts or prefix.endswith(name) for name in self.excluded):
            return True
        return any(re.match(rule[2:], prefix) for rule in self.dynamic)


def _shared_by_shards(param: torch.nn.Parameter) -> None:
    """Load `param` whole from each fused projection's tensor: they share the layer's input and so its act-order;
    a ModelLoadError when two projections disagree."""
    load, loaded_once = param.weight_loader, []  # type: ignore[attr-defined]

    def load_shared(target: torch.nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        before = target.data.clone() if loaded_once else None
        load(target, loaded)
        if before is not None and not torch.equal(before, target.data):
            raise ModelLoadError(f"g_idx of fused projection {shard_id!r} differs from its siblings' (same input, "
                                 "so the same act-order is expected)")
        loaded_once.append(shard_id)

    param.weight_loader = load_shared  # type: ignore[attr-defined]


def _check_divides(layer: LinearBase, size: int, by: int, what: str) -> None:
    if size % by:
        raise ModelLoadError(f"{layer.prefix}: this rank's {size} {what} do not divide into GPTQ's {by}")


def _total_groups(layer: LinearBase, group_size: int) -> int:
    """Groups along the whole (unsplit) input of the layer."""
    return 1 if group_size == -1 else layer.input_size * layer.input_split[1] // group_size
