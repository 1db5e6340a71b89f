"""The gated RMSNorm of Mamba 2 and gated delta nets: RMSNorm over groups, gated by silu(z).

`norm_before_gate=False` (Mamba 2, Bamba, NemotronH, Zamba 2): norm(y * silu(z)) * w;
`norm_before_gate=True` (gated delta nets, Falcon-H1's option): norm(y) * w * silu(z).
Computed in float32, rounded once, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.rowwise import rowwise
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["GatedRMSNorm"]


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of `group_size` features of [..., hidden_size], gated by silu(z)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6, norm_before_gate: bool = False) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"gated RMSNorm: {hidden_size} features do not split into groups of {group_size}")
        self.group_size, self.variance_epsilon, self.norm_before_gate = group_size, eps, norm_before_gate
        self.weight = frozen_parameter(torch.ones(hidden_size), default_weight_loader)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z [..., hidden_size] -> [..., hidden_size] in y's dtype."""
        dtype, gate = y.dtype, rowwise(F.silu, z.float())
        y = y.float()
        if not self.norm_before_gate:
            y = y * gate
        groups = y.unflatten(-1, (-1, self.group_size))
        y = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).flatten(-2)
        y = y * self.weight.float()
        if self.norm_before_gate:
            y = y * gate
        return y.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, group_size={self.group_size}, norm_before_gate={self.norm_before_gate}"
