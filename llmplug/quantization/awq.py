"""AWQ checkpoints (AutoAWQ, version "gemm"): quant_method "awq", 4-bit integer groups with zero points.

A quantized linear layer's tensors (K inputs, N outputs): qweight int32 [K, N / 8] and qzeros int32 [G, N / 8],
both packed along N with AWQ's interleaved nibble order (the word's i-th nibble holds output 8 c + AWQ_ORDER[i]),
scales float16 [G, N]; w = (q - z) * s. Layers in `modules_to_not_convert` are dense.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from llmplug.core.errors import ModelLoadError
from llmplug.quantization.base import QuantizationConfig, QuantizedExpertsMethod
from llmplug.quantization.int_weights import IntWeights, IntWeightsMethod, float_loader, unpack_int32

if TYPE_CHECKING:
    from llmplug.layers.linear import LinearBase
    from llmplug.layers.moe.experts import FusedExperts

__all__ = ["AWQ_ORDER", "AWQConfig", "AWQLinearMethod"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PACK = 8  # 4-bit values per int32
_GROUP_SIZES = (32, 64, 128)


class AWQLinearMethod(IntWeightsMethod):
    """One AWQ (GEMM) layer: the checkpoint's qweight / qzeros / scales, repacked for the int4 kernel."""

    bits = 4
    checkpoint_tensors = ("qweight", "qzeros", "scales")

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size

    def create_weights(self, layer: LinearBase) -> None:
        k, n = layer.input_size, layer.output_size
        if n % _PACK or k % self.group_size:
            raise ModelLoadError(
                f"{layer.prefix}: this rank's {n} outputs / {k} inputs do not divide into AWQ's packs of {_PACK} / "
                f"groups of {self.group_size} (choose another tensor_parallel_size)"
            )
        groups = k // self.group_size
        layer.create_parameter("qweight", (k, n // _PACK), torch.int32, output_dim=1, input_dim=0, output_pack=_PACK)
        layer.create_parameter("qzeros", (groups, n // _PACK), torch.int32, output_dim=1, input_dim=0,
                               output_pack=_PACK)
        float_loader(layer.create_parameter("scales", (groups, n), torch.float32, output_dim=1, input_dim=0))

    def int_weights(self, layer: LinearBase) -> IntWeights:
        q = unpack_int32(layer.qweight, 4, dim=1, order=AWQ_ORDER).t()  # [N, K]
        zero = unpack_int32(layer.qzeros, 4, dim=1, order=AWQ_ORDER).t().float()  # [N, G]
        return IntWeights(q.contiguous(), layer.scales.t().contiguous(), zero.contiguous(), self.bits)


class AWQConfig(QuantizationConfig):
    """An AWQ checkpoint's settings."""

    name = "awq"

    def __init__(self, group_size: int, excluded: tuple[str, ...]) -> None:
        self.group_size, self.excluded = group_size, excluded

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit"))
        group_size = config.get("group_size", config.get("q_group_size"))
        version = str(config.get("version", "gemm")).lower()
        zero_point = config.get("zero_point", True)
        if version != "gemm":
            raise ModelLoadError(f"AWQ version={config.get('version')!r} is not implemented (llmplug reads 'gemm')")
        if bits != 4:
            raise ModelLoadError(f"AWQ bits={bits!r} is not implemented (llmplug reads 4-bit AWQ)")
        if group_size not in _GROUP_SIZES:
            raise ModelLoadError(f"AWQ group_size={group_size!r} is not implemented (llmplug reads {_GROUP_SIZES})")
        if not zero_point:
            raise ModelLoadError("AWQ zero_point=false is not implemented (llmplug reads AWQ with zero points)")
        return cls(group_size, tuple(config.get("modules_to_not_convert") or ()))

    def linear_method(self, layer: LinearBase, prefix: str) -> AWQLinearMethod | None:
        return None if self._dense(prefix) else AWQLinearMethod(self.group_size)

    def experts_method(self, experts: FusedExperts, prefix: str) -> QuantizedExpertsMethod | None:
        """The routed experts: llmplug.quantization.int_experts."""
        if self._dense(f"{prefix}.0.gate_proj"):
            return None
        from llmplug.quantization.int_experts import AWQExpertsMethod

        return AWQExpertsMethod(4, self.group_size)

    def _dense(self, prefix: str) -> bool:
        """Whether the checkpoint keeps layer `prefix` unquantized (`modules_to_not_convert`)."""
        parts = prefix.split(".")
        return any(name in parts or prefix.endswith(name) for name in self.excluded)
