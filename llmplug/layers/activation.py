"""Gated activations of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.kernels import use_triton

__all__ = ["SiluAndMul"]


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up]: [..., 2 * d] -> [..., d] (SwiGLU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] -> [..., d]; one Triton kernel on a GPU (`use_triton`)."""
        d = x.shape[-1] // 2
        if use_triton(x):
            from llmplug.layers.kernels.activation import silu_and_mul

            return silu_and_mul(x.reshape(-1, 2 * d)).view(*x.shape[:-1], d)
        return F.silu(x[..., :d]).mul_(x[..., d:])
