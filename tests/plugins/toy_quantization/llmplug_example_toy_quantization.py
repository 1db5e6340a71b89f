"""Example quantization plugin: `quant_method: toy-int8`, symmetric int8 weights with one float32 scale per output.

A checkpoint of this format stores, for each quantized linear module `<m>` (transformers' names), `<m>.qweight`
(int8 [out, in]) and `<m>.weight_scale` (float32 [out]); the weight is qweight * weight_scale[:, None]. config.json
says `"quantization_config": {"quant_method": "toy-int8", "bits": 8, "ignore": [...]}`, `ignore` naming modules
kept dense. The engine finds this class by its entry point alone (pyproject.toml); the layers register the
tensors with `layer.create_parameter`, which shards them for tensor parallelism and places them in fused
projections (q, k, v -> qkv_proj) exactly as it does dense weights.

The compute is the smallest honest one: x times the dequantized weight, one output row at a time as a product
and a sum over the input features, so each row's result does not depend on how many rows share the call.
"""

from __future__ import annotations

from typing import Any

import torch

from llmplug.core.errors import ModelLoadError
from llmplug.quantization import QuantizationConfig, QuantizedLinearMethod

LLMPLUG_PLUGIN_API_VERSION = "1.7"

KNOWN_SETTINGS = {"quant_method", "bits", "ignore"}


class ToyInt8Method(QuantizedLinearMethod):
    """One layer: int8 [out, in] and a float32 scale per output row."""

    row_invariant = True

    def create_weights(self, layer: Any) -> None:
        layer.create_parameter("qweight", (layer.output_size, layer.input_size), torch.int8, output_dim=0, input_dim=1)
        layer.create_parameter("weight_scale", (layer.output_size,), torch.float32, output_dim=0, input_dim=None)

    def dequantize(self, layer: Any) -> torch.Tensor:
        return layer.qweight.to(torch.float32) * layer.weight_scale[:, None]  # [out, in]

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.dequantize(layer).to(x.dtype)
        y = (x.unsqueeze(-2) * weight).sum(-1)  # [..., 1, in] * [out, in] -> [..., out]: rows computed apart
        return y if bias is None else y + bias


class ToyInt8Config(QuantizationConfig):
    """config.json's `quantization_config` of a toy-int8 checkpoint."""

    name = "toy-int8"

    def __init__(self, ignore: list[str]) -> None:
        self.ignore = list(ignore)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ToyInt8Config:
        unknown = sorted(set(config) - KNOWN_SETTINGS)
        if unknown:
            raise ModelLoadError(f"toy-int8: quantization_config has settings it does not implement: {unknown}")
        if config.get("bits", 8) != 8:
            raise ModelLoadError(f"toy-int8: bits={config['bits']!r} is not implemented; only 8")
        return cls(config.get("ignore", []))

    def linear_method(self, layer: Any, prefix: str) -> ToyInt8Method | None:
        ignored = any(prefix == name or prefix.endswith("." + name) for name in self.ignore)
        return None if ignored else ToyInt8Method()
