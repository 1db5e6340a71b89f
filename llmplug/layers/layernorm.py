"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.kernels import use_triton
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (computed in float32)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size, self.variance_epsilon = hidden_size, eps
        self.weight = frozen_parameter(torch.ones(hidden_size), default_weight_loader)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum written into x in place.

        The in-place add is safe in a decoder because x is the fresh output of the sublayer before.
        On a GPU one Triton kernel does both (`use_triton`).
        """
        if use_triton(x):
            return self._forward_triton(x, residual)
        if residual is None:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.variance_epsilon)
        residual = x.add_(residual)
        return F.rms_norm(residual, (self.hidden_size,), self.weight, self.variance_epsilon), residual

    def _forward_triton(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from llmplug.layers.kernels.rms_norm import rms_norm

        if residual is None:
            return rms_norm(x.reshape(-1, self.hidden_size), self.weight, self.variance_epsilon).view(x.shape)
        rows = x.view(-1, self.hidden_size)  # a view: the kernel writes the sum into x
        out = rms_norm(rows, self.weight, self.variance_epsilon, residual.reshape(-1, self.hidden_size))
        return out.view(x.shape), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
