"""Gated activations of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SiluAndMul"]


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up]: [..., 2 * d] -> [..., d] (SwiGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] -> [..., d]."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]).mul_(x[..., d:])
