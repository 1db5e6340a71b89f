"""The router of a mixture-of-experts layer: which experts each token goes to, and with what weight."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.moe.config import RouterConfig
from llmplug.layers.packed_linear import cpu_dense_method
from llmplug.layers.rowwise import rowwise
from llmplug.layers.weight_utils import check_shape, default_weight_loader, frozen_parameter

if TYPE_CHECKING:
    from llmplug.layers.quantization import LinearMethod, LinearOptions

__all__ = ["Router", "select_experts"]


class Router(nn.Module):
    """logits = x W^T (+ bias) over the experts, then `select_experts`; held whole by every rank.

    Parameters (transformers' names under the MoE block's `gate`): `weight` [E, hidden], optional
    `bias` [E], optional `e_score_correction_bias` [E] (float32).
    """

    def __init__(self, config: RouterConfig, hidden_size: int) -> None:
        super().__init__()
        self.config = config
        dtype = torch.float32 if config.float32 else None  # None: the model's dtype
        num_experts = config.num_experts
        self.weight = frozen_parameter(torch.empty(num_experts, hidden_size, dtype=dtype), default_weight_loader)
        self.bias = None
        if config.bias:
            self.bias = frozen_parameter(torch.empty(num_experts, dtype=dtype), default_weight_loader)
        self.e_score_correction_bias = None
        if config.correction_bias:
            bias = torch.empty(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = frozen_parameter(bias, _load_flattened)
        self.packed: LinearMethod | None = None  # batch-invariant mode: see process_weights_after_loading

    def process_weights_after_loading(self, options: LinearOptions) -> None:
        """Batch-invariant mode: the logits through oneDNN's packed matmul (or F.linear where it cannot pack), by
        the weight's row plan: F.linear's float32 kernel (MKL) changes with the row count, and the routing weights
        of a token would then depend on its batch. Redone after every weight update, as for linear layers."""
        self.packed = cpu_dense_method(self.weight, options.row_invariant, options.row_invariant)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
        x = x.float() if self.config.float32 else x
        if self.packed is not None:
            logits = self.packed.apply(self, x, self.bias)  # [T, E]
        else:
            logits = F.linear(x, self.weight, self.bias)
        return select_experts(logits, self.config, self.e_score_correction_bias)

    def extra_repr(self) -> str:
        c = self.config
        return f"experts={c.num_experts}, top_k={c.top_k}, scoring={c.scoring}"


def _load_flattened(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """The correction bias [E]; ERNIE stores it as [1, E]."""
    check_shape(param, loaded.reshape(-1) if loaded.dim() == 2 and loaded.shape[0] == 1 else loaded)
    param.data.copy_(loaded.reshape(-1))


def select_experts(
    logits: torch.Tensor, config: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k]); see RouterConfig."""
    logits = logits.float()
    if config.scoring == "sparsemixer":
        weights, ids = _sparsemixer(logits, config.sparsemixer_eps)
    else:
        scores = logits.softmax(dim=-1) if config.scoring == "softmax" else rowwise(torch.sigmoid, logits)  # [T, E]
        choice = scores if correction_bias is None else scores + correction_bias
        if config.num_groups > 1:
            choice = _only_best_groups(choice, config)
        ids = choice.topk(config.top_k, dim=-1).indices  # [T, top_k]
        weights = scores.gather(1, ids)
    if config.topk_norm is not None:
        p = config.topk_norm
        norm = weights.sum(dim=-1, keepdim=True) if p == 1.0 else weights.norm(p=p, dim=-1, keepdim=True)
        weights = weights / norm
    if config.scaling_factor != 1.0:
        weights = weights * config.scaling_factor
    return weights, ids


def _only_best_groups(choice: torch.Tensor, config: RouterConfig) -> torch.Tensor:
    """choice [T, E] with every expert outside the token's best `topk_groups` groups set to -inf."""
    num_tokens, num_experts, groups = choice.shape[0], choice.shape[1], config.num_groups
    grouped = choice.view(num_tokens, groups, num_experts // groups)  # [T, G, E / G]
    if config.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    best = group_scores.topk(config.topk_groups, dim=-1).indices  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)


def _sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Phi-3.5-MoE's top-2 (inference form): each of the two picks is the best remaining logit, weighed
    by a softmax over the logits within a relative distance 2 * eps of it."""
    first_value, first = logits.max(dim=-1, keepdim=True)  # [T, 1]
    first_weight = _masked_softmax(logits, logits, first_value, eps).gather(1, first)
    rest = logits.scatter(1, first, float("-inf"))
    second_value, second = rest.max(dim=-1, keepdim=True)
    second_weight = _masked_softmax(rest, logits, second_value, eps).gather(1, second)
    return torch.cat([first_weight, second_weight], dim=1), torch.cat([first, second], dim=1)


def _masked_softmax(candidates: torch.Tensor, logits: torch.Tensor, best: torch.Tensor, eps: float) -> torch.Tensor:
    """softmax of `candidates` [T, E] keeping those with (best - logit) / max(|logit|, best) <= 2 * eps."""
    far = (best - logits) / logits.abs().clamp(min=best) > 2 * eps
    return candidates.masked_fill(far, float("-inf")).softmax(dim=-1)
