"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
        """
        if residual is None:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.variance_epsilon)
        residual = x.add_(residual)
        return F.rms_norm(residual, (self.hidden_size,), self.weight, self.variance_epsilon), residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
