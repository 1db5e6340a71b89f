"""Norms of the query and key projections, applied before rotary embedding (or after it: `after_rope`).

Three scopes, as families use them (`QKNormConfig.scope`):
- "head": every head normalized over head_dim with one weight [head_dim] shared by all heads
  (Qwen3, Gemma 3, Phi with qk_layernorm);
- "per_head": every head normalized over head_dim with its own weight row, one tensor [heads, head_dim]
  (Cohere's use_qk_norm, a LayerNorm without bias);
- "projection": the whole projection (all heads) normalized at once with a weight [heads * head_dim]
  (OLMo 2). Under tensor parallelism each rank holds some heads, so the mean of squares is summed
  over the ranks before normalizing: the result is that of the unsharded model.

`make_qk_norm` builds the right module: a plain RMSNorm / LayerNorm over head_dim for "head",
a `ShardedHeadsNorm` otherwise. A rank holds heads [first_head, first_head + num_heads) of the
checkpoint's, and a ShardedHeadsNorm's weight_loader copies those rows. Every one maps
x [T, heads, head_dim] to a new tensor of that shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.layers.layernorm import NormConfig, make_norm
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["QKNormConfig", "ShardedHeadsNorm", "make_qk_norm"]


@dataclass(frozen=True, slots=True)
class QKNormConfig:
    """The q/k norm of an attention block: which norm, over what."""

    norm: NormConfig
    scope: Literal["head", "per_head", "projection"] = "head"
    after_rope: bool = False  # normalize the rotated q and k (HunYuan, NanoChat); default: before rotary


def make_qk_norm(config: QKNormConfig, num_heads: int, head_dim: int, first_head: int) -> nn.Module:
    """The q (or k) norm of this rank's `num_heads` heads, starting at the checkpoint's head `first_head`."""
    if config.scope == "head":
        return make_norm(config.norm, head_dim)
    return ShardedHeadsNorm(config, num_heads, head_dim, first_head)


class ShardedHeadsNorm(nn.Module):
    """A q/k norm with a weight per head ("per_head") or over the whole projection ("projection")."""

    def __init__(self, config: QKNormConfig, num_heads: int, head_dim: int, first_head: int) -> None:
        super().__init__()
        self.scope, self.num_heads, self.head_dim, self.first_head = config.scope, num_heads, head_dim, first_head
        norm = config.norm
        if config.scope not in ("per_head", "projection"):
            raise ValueError(f"ShardedHeadsNorm normalizes per_head or projection, not {config.scope!r}")
        if (
            norm.weight_offset
            or not norm.has_weight
            or norm.bias
            or (config.scope == "projection" and norm.kind != "rms")
        ):
            raise ValueError(f"q/k norm scope {config.scope!r} is not implemented for {norm}")
        self.kind, self.eps = norm.kind, norm.eps
        shape = (num_heads, head_dim) if config.scope == "per_head" else (num_heads * head_dim,)
        self.weight = frozen_parameter(torch.ones(shape), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's heads of the checkpoint's weight ([heads, head_dim] or [heads * head_dim])."""
        rows = loaded_weight.reshape(-1, self.head_dim).narrow(0, self.first_head, self.num_heads)
        default_weight_loader(param, rows.reshape(param.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, num_heads, head_dim] -> normalized, same shape and dtype (computed in float32)."""
        if self.scope == "per_head":
            normalized = self._per_head_unit_norm(x.float())
        else:
            normalized = x.float() * torch.rsqrt(self._mean_square_over_ranks(x) + self.eps)
        return (normalized * self.weight.float().reshape(self.num_heads, self.head_dim)).to(x.dtype)

    def _per_head_unit_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Each head of x normalized over head_dim, without a scale."""
        if self.kind == "rms":
            return F.rms_norm(x, (self.head_dim,), None, self.eps)
        return F.layer_norm(x, (self.head_dim,), None, None, self.eps)

    def _mean_square_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 1, 1]: mean of x^2 over every head of every rank (all ranks hold equally many)."""
        tp = get_tp_group()
        sum_square = x.float().pow(2).sum(dim=(1, 2), keepdim=True)  # [T, 1, 1]
        if tp.world_size > 1:
            sum_square = tp.all_reduce(sum_square)
        return sum_square / (x.shape[1] * x.shape[2] * tp.world_size)

    def extra_repr(self) -> str:
        return f"scope={self.scope}, heads={self.num_heads} from {self.first_head}, head_dim={self.head_dim}"
