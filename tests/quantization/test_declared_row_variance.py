"""A quantized method that declares its rows depend on their number is named by the batch-invariance check, so the
engine's `auto` mode turns off (and `true` is refused) for it as for a dense kernel without a row plan."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmplug.layers.linear import ColumnParallelLinear
from llmplug.layers.packed_linear import row_variant_weights
from llmplug.quantization import QuantizationConfig, QuantizedLinearMethod, building_with


class _Method(QuantizedLinearMethod):
    def __init__(self, row_invariant: bool) -> None:
        self.row_invariant = row_invariant

    def create_weights(self, layer) -> None:
        layer.create_parameter("qweight", (layer.output_size, layer.input_size), torch.int8, 0, 1)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x @ self.dequantize(layer).t()

    def dequantize(self, layer) -> torch.Tensor:
        return layer.qweight.float()


class _Config(QuantizationConfig):
    name = "declared"

    def __init__(self, invariant_prefixes: set[str]) -> None:
        self.invariant_prefixes = invariant_prefixes

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        return cls(set(config["invariant"]))

    def linear_method(self, layer, prefix: str) -> QuantizedLinearMethod | None:
        return None if prefix == "dense" else _Method(prefix in self.invariant_prefixes)


def test_layers_whose_method_declares_row_dependence_are_named() -> None:
    with building_with(_Config({"a"})):
        model = nn.ModuleDict({
            "a": ColumnParallelLinear(8, 16, bias=False, prefix="a"),
            "b": ColumnParallelLinear(8, 16, bias=False, prefix="b"),
            "dense": ColumnParallelLinear(8, 16, bias=False, prefix="dense"),
        })
    assert model["a"].weight is None and model["dense"].weight is not None  # built in the checkpoint's form or dense
    assert row_variant_weights(model) == ["b (_Method, whose rows depend on their number)"]


def test_a_model_of_invariant_methods_names_nothing() -> None:
    with building_with(_Config({"a"})):
        model = nn.ModuleDict({"a": ColumnParallelLinear(8, 16, bias=False, prefix="a")})
    assert row_variant_weights(model) == []
