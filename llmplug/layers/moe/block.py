"""The mixture-of-experts MLP block: router, routed experts, optional (gated) shared experts."""

from __future__ import annotations

import torch
from torch import nn

from llmplug.communicators.parallel_state import expert_parallel_enabled, get_tp_group
from llmplug.layers.decoder.arch import MLPConfig
from llmplug.layers.decoder.mlp import DecoderMLP
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.moe.config import MoEConfig
from llmplug.layers.moe.experts import FusedExperts
from llmplug.layers.moe.router import Router
from llmplug.layers.rowwise import rowwise
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["SparseMoeBlock"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class SparseMoeBlock(nn.Module):
    """x -> sum of the chosen experts' weighted outputs (+ shared experts, optionally gated).

    Modules, with transformers' names (most checkpoints need no renames): `gate` (the Router),
    `experts` (FusedExperts), `shared_experts` (a DecoderMLP) and `shared_expert_gate` (a
    linear layer hidden -> 1), and `bias` (added to the output, `MoEConfig.output_bias`). Under tensor
    parallelism the router and gate are replicated, the experts and shared experts sharded (by slices of
    every expert, or whole experts per rank with `expert_parallel`, default:
    ParallelConfig.enable_expert_parallel); the summed partial outputs are all-reduced once,
    unless `reduce_results=False` (the caller reduces, e.g. with a parallel residual).
    """

    def __init__(
        self,
        config: MoEConfig,
        hidden_size: int,
        prefix: str = "",
        reduce_results: bool = True,
        expert_parallel: bool | None = None,
    ) -> None:
        super().__init__()
        self.gate = Router(config.router, hidden_size)
        if expert_parallel is None:
            expert_parallel = expert_parallel_enabled()
        # a quantized checkpoint's method holds the experts packed, or refuses them by name (FusedExperts asks it)
        self.experts = FusedExperts(config, hidden_size, expert_parallel, _join(prefix, "experts"))
        self.shared_experts = None
        if config.shared_intermediate_size:
            shared = MLPConfig(config.activation, bias=config.shared_bias)
            self.shared_experts = DecoderMLP(
                shared, hidden_size, config.shared_intermediate_size, _join(prefix, "shared_experts"), False
            )
        self.shared_expert_gate = None
        if config.shared_expert_gate:
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, False, _join(prefix, "shared_expert_gate"))
        self.bias = None
        if config.output_bias:
            self.bias = frozen_parameter(torch.empty(hidden_size), default_weight_loader)
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] (this rank's partial sum when reduce_results=False)."""
        weights, ids = self.gate(x)  # [T, k] float32, [T, k]
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = shared * rowwise(torch.sigmoid, self.shared_expert_gate(x))  # [T, 1]
            out = out + shared
        tp = get_tp_group()
        if self.bias is not None and tp.rank_in_group == 0:  # added once to the ranks' sum
            out = out + self.bias
        return tp.all_reduce(out) if self.reduce_results and tp.world_size > 1 else out
