"""Mixture-of-experts MLP: one implementation every MoE family uses.

Exports the typed config (`MoEConfig`, `RouterConfig`), the block (`SparseMoeBlock`) and its parts
(`Router`, `select_experts`, `FusedExperts`), and `EXPERT_PARAMS`, the map from per-expert checkpoint
names to the stacked parameters (pass it to `load_mapped_weights(..., experts=EXPERT_PARAMS)`).

    block = SparseMoeBlock(MoEConfig(RouterConfig(num_experts=8, top_k=2, topk_norm=1.0),
                                     intermediate_size=1024), hidden_size=512, prefix="model.layers.0.mlp")
    out = block(x)  # x [T, 512] -> [T, 512], all-reduced over the tensor-parallel ranks

See docs/models.md ("Mixture of experts").
"""

from llmplug.layers.moe.block import SparseMoeBlock
from llmplug.layers.moe.config import MoEConfig, RouterConfig
from llmplug.layers.moe.experts import EXPERT_PARAMS, FusedExperts
from llmplug.layers.moe.router import Router, select_experts

__all__ = ["EXPERT_PARAMS", "FusedExperts", "MoEConfig", "Router", "RouterConfig", "SparseMoeBlock", "select_experts"]
