"""The quantization protocol (after vLLM's `QuantizationConfig` / `QuantizeMethodBase`): a plugin group.

A method is registered in the `llmplug.quantization` entry-point group under the name a checkpoint's
`config.json` gives (`quantization_config.quant_method`), and has two parts:

- a `QuantizationConfig` class: `from_config(quantization_config)` reads the checkpoint's settings (a
  `ModelLoadError` for a setting it does not implement, naming it), and `linear_method(layer, prefix)` says
  how one linear layer is stored and computed (None: that layer is dense, e.g. one the format leaves out);
- a `QuantizedLinearMethod` per layer: `create_weights(layer)` registers the checkpoint's tensors in their
  packed form with `layer.create_parameter` (which shards them for tensor parallelism and fused projections
  as the layer does its dense weight), `process_weights_after_loading(layer, options)` repacks them once for
  the kernel, and `apply(layer, x, bias)` computes x W^T + b;
- a `QuantizedExpertsMethod` per mixture-of-experts layer (`experts_method(experts, prefix)`, after vLLM's
  `FusedMoEMethodBase`): the same three steps for the stacked routed experts (`FusedExperts`), whose `apply`
  computes one expert's projection on the rows routed to it.

The loader reads the method from the checkpoint (`resolve_quantization`), or from `quantization: NAME`, and
builds the model inside `building_with(config)` (llmplug.quantization.context) so each layer gets its method
when it is created; no dense copy of a weight is ever made (docs/quantization.md).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from llmplug.core.errors import ModelLoadError

if TYPE_CHECKING:
    from llmplug.layers.linear import LinearBase
    from llmplug.layers.moe.experts import FusedExperts
    from llmplug.layers.quantization import LinearOptions

__all__ = ["QuantizationConfig", "QuantizedExpertsMethod", "QuantizedLinearMethod", "refuse_experts"]


class QuantizedLinearMethod(abc.ABC):
    """How one linear layer holds and computes with a checkpoint's quantized weight."""

    # whether `apply`'s output rows are bitwise the same whatever the number of rows x has (one token alone or
    # in any batch): what the batch-invariant mode needs (docs/determinism.md); a method whose kernel changes its
    # blocking with the row count says False, and llmplug.testing.check_quantization_method reports it
    row_invariant: ClassVar[bool] = True

    @abc.abstractmethod
    def create_weights(self, layer: LinearBase) -> None:
        """Register the layer's tensors in the checkpoint's form (`layer.create_parameter`); shapes are this
        rank's (`layer.input_size`, `layer.output_size`)."""

    def process_weights_after_loading(self, layer: LinearBase, options: LinearOptions) -> None:
        """Turn the loaded tensors into the kernel's form (once, after loading); default: nothing."""

    @abc.abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[..., in] -> [..., out]: x W^T + b."""

    @abc.abstractmethod
    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The dense weight [out, in] the layer computes with (in float32): the reference of the method's tests
        and the fallback of paths that need a dense weight."""


class QuantizedExpertsMethod(abc.ABC):
    """How a mixture-of-experts layer's routed experts hold and compute with a checkpoint's quantized weights.

    Each expert has two projections, named as FusedExperts' stacked dense weights: "gate_up_proj" ([2 I, hidden]:
    the checkpoint's gate_proj rows, then up_proj's) and "down_proj" ([hidden, I]); I is this rank's share of the
    intermediate features. One method serves one FusedExperts; the expert index is the local one.
    """

    # whether `apply`'s rows are bitwise the same whatever the number of rows routed to the expert (what the
    # batch-invariant mode needs, as QuantizedLinearMethod.row_invariant)
    row_invariant: ClassVar[bool] = True

    @abc.abstractmethod
    def create_weights(self, experts: FusedExperts) -> None:
        """Register the checkpoint's tensors stacked over the local experts (`experts.create_parameter`); a
        ModelLoadError naming the layer for a tensor-parallel size that cuts the format's groups or blocks."""

    def process_weights_after_loading(self, experts: FusedExperts, options: LinearOptions) -> None:
        """Turn the loaded tensors into the kernel's form (once, after loading); default: nothing."""

    @abc.abstractmethod
    def apply(self, experts: FusedExperts, expert: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        """Local expert `expert`'s `projection` on the rows routed to it: x [n, in] -> x W^T [n, out]."""

    @abc.abstractmethod
    def dequantize(self, experts: FusedExperts, expert: int, projection: str) -> torch.Tensor:
        """The dense weight [out, in] (float32) local expert `expert`'s `projection` computes with."""


def refuse_experts(method: str, prefix: str) -> ModelLoadError:
    """The error of a method that cannot hold the quantized experts of the mixture-of-experts layer `prefix`."""
    return ModelLoadError(
        f"{prefix}: {method} checkpoints of mixture-of-experts models are not supported: no method holds their "
        "experts quantized (docs/quantization.md lists the formats whose experts load); use the model's dense "
        "(bf16/fp16) checkpoint or one of those formats"
    )


class QuantizationConfig(abc.ABC):
    """A checkpoint's quantization settings and the methods they give each layer."""

    name: ClassVar[str]  # the quant_method it is registered as

    @classmethod
    @abc.abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Read config.json's `quantization_config` (ModelLoadError naming a setting it does not implement)."""

    @abc.abstractmethod
    def linear_method(self, layer: LinearBase, prefix: str) -> QuantizedLinearMethod | None:
        """The method of the linear `layer` named `prefix` (None: the checkpoint keeps it dense)."""

    def experts_method(self, experts: FusedExperts, prefix: str) -> QuantizedExpertsMethod | None:
        """The method of the routed experts named `prefix` (FusedExperts asks as it is built; None: the checkpoint
        keeps them dense). Default: `check_experts`, then dense."""
        self.check_experts(prefix)
        return None

    def check_experts(self, prefix: str) -> None:
        """Called by the default `experts_method`: a method that holds no quantized experts refuses a quantized
        MoE checkpoint by name rather than load it wrong; one whose checkpoints keep the experts dense overrides
        this to pass (GGUF's)."""
        raise refuse_experts(self.name, prefix)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """Activation dtypes the method computes in."""
        return (torch.float32, torch.bfloat16, torch.float16)
