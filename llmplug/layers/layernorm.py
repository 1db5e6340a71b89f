"""RMSNorm and LayerNorm with their variants, optionally fused with the residual add before them.

Both take `norm(x)` or `norm(x, residual)`; the second form returns (norm(x + residual), x + residual)
and writes the sum into x, which is how a decoder carries its residual stream between layers.

Variants, all flags of the two classes (`make_norm` builds one from a `NormConfig`):
- `weight_offset`: the scale is `offset + weight` (Gemma's RMSNorm `1 + w`, Nemotron's layernorm1p);
  such norms compute in float32 and round once at the end, as transformers does;
- `has_weight=False`: no learned scale (OLMo's LayerNorm, weightless RMSNorm);
- LayerNorm `bias`: with or without a learned shift.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.kernels import use_triton
from llmplug.layers.kernels.native import ops, use_native
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["LayerNorm", "NormConfig", "RMSNorm", "make_norm"]

# rms_norm(rows [N, C], weight [C], eps, residual rows [N, C] or None) -> [N, C]; the sum written into rows
RMSNormKernel = Callable[..., torch.Tensor]


@dataclass(frozen=True, slots=True)
class NormConfig:
    """Which normalization a model uses, and its variant."""

    kind: Literal["rms", "layer"] = "rms"
    eps: float = 1e-6
    has_weight: bool = True  # False: no learned scale
    bias: bool = False  # LayerNorm only: a learned shift
    weight_offset: float = 0.0  # scale = weight_offset + weight (Gemma's RMSNorm: 1.0)


class _Norm(nn.Module, abc.ABC):
    """Shared parameters and the fused residual add; subclasses define `_normalize`."""

    def __init__(self, hidden_size: int, eps: float, has_weight: bool, bias: bool, weight_offset: float) -> None:
        super().__init__()
        self.hidden_size, self.variance_epsilon, self.weight_offset = hidden_size, eps, weight_offset
        init = torch.zeros(hidden_size) if weight_offset else torch.ones(hidden_size)
        self.weight = frozen_parameter(init, default_weight_loader) if has_weight else None
        self.bias = frozen_parameter(torch.zeros(hidden_size), default_weight_loader) if bias else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum written into x in place.

        The in-place add is safe in a decoder because x is the fresh output of the sublayer before.
        """
        if residual is None:
            return self._normalize(x)
        residual = x.add_(residual)
        return self._normalize(residual), residual

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., hidden]: this norm without the residual add."""
        if not self.weight_offset or self.weight is None:
            return self._functional(x, self.weight, self.bias)
        scale = self.weight.float() + self.weight_offset
        bias = None if self.bias is None else self.bias.float()
        return self._functional(x.float(), scale, bias).to(x.dtype)

    @abc.abstractmethod
    def _functional(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        """The normalization itself, with the given scale and shift."""

    def extra_repr(self) -> str:
        flags = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        flags += "" if self.weight is not None else ", no weight"
        return f"{self.hidden_size}, eps={self.variance_epsilon}{flags}"


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * scale over the last dimension (computed in float32)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, *, has_weight: bool = True, weight_offset: float = 0.0
    ) -> None:
        super().__init__(hidden_size, eps, has_weight, False, weight_offset)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As `_Norm.forward`; a plain RMSNorm (a weight, no offset) is one kernel, residual add included: Triton
        on a GPU (`use_triton`), llmplug's own on the CPU (`use_native`)."""
        kernel = self._kernel(x)
        if kernel is None:
            return super().forward(x, residual)
        if x.dim() == 2 and x.stride(1) == 1 and (residual is None or residual.stride(1) == 1):  # the kernels' layout
            if residual is None:
                return kernel(x, self.weight, self.variance_epsilon)
            return kernel(x, self.weight, self.variance_epsilon, residual), x
        if residual is None:
            return kernel(x.reshape(-1, self.hidden_size), self.weight, self.variance_epsilon).view(x.shape)
        rows = x.view(-1, self.hidden_size)  # a view: the kernel writes the sum into x
        out = kernel(rows, self.weight, self.variance_epsilon, residual.reshape(-1, self.hidden_size))
        return out.view(x.shape), x

    @property
    def plain(self) -> bool:
        """A weight and no offset: the form the fused kernels compute (one call, the residual add included)."""
        return self.weight is not None and not self.weight_offset

    def _kernel(self, x: torch.Tensor) -> RMSNormKernel | None:
        """The fused kernel that normalizes x, if one does: rms_norm(rows, weight, eps, residual rows or None)."""
        if not self.plain:
            return None
        if use_triton(x):
            from llmplug.layers.kernels.rms_norm import rms_norm

            return rms_norm
        return _native_rms_norm if use_native(x) and self.weight.dtype == x.dtype else None

    def _functional(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), weight, self.variance_epsilon)


def _native_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """llmplug's CPU kernel with the Triton kernel's signature (`kernels.rms_norm.rms_norm`)."""
    if residual is None:
        return ops().rms_norm(x, weight, eps)
    return ops().fused_add_rms_norm(x, residual, weight, eps)


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * scale + bias over the last dimension."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        *,
        bias: bool = True,
        has_weight: bool = True,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__(hidden_size, eps, has_weight, bias, weight_offset)

    def _functional(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        if weight is None:  # weightless (OLMo): normalized in float32, as transformers does
            return F.layer_norm(x.float(), (self.hidden_size,), None, bias, self.variance_epsilon).to(x.dtype)
        return F.layer_norm(x, (self.hidden_size,), weight, bias, self.variance_epsilon)


def make_norm(config: NormConfig, hidden_size: int) -> RMSNorm | LayerNorm:
    """The norm `config` describes over `hidden_size` features."""
    if config.kind == "rms":
        if config.bias:
            raise ValueError("RMSNorm has no bias; NormConfig(kind='rms', bias=True) describes no known norm")
        return RMSNorm(hidden_size, config.eps, has_weight=config.has_weight, weight_offset=config.weight_offset)
    return LayerNorm(
        hidden_size, config.eps, bias=config.bias, has_weight=config.has_weight, weight_offset=config.weight_offset
    )
