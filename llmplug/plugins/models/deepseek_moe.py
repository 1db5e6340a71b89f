"""DeepSeek's mixture of experts as other families reuse it: the router of V2 / V3 and dense first layers.

V3's router (GLM-4.5, dots.llm1, ...): sigmoid scores, a score-correction bias to choose, groups scored
by their best two experts, renormalised when `norm_topk_prob`, times `routed_scaling_factor`, logits in
float32. V2's: softmax, greedy or group-limited (groups scored by their best expert), scaled. Both
add `n_shared_experts` shared experts of `moe_intermediate_size` each, and keep the first
`first_k_dense_replace` layers dense. Their checkpoints store a multi-token-prediction layer after the
last one, which is dropped as transformers drops it.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import LayerConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.plugins.models.arch_config import moe_layers

__all__ = ["deepseek_moe", "deepseek_v2_router", "deepseek_v3_router", "first_k_dense", "next_layer_dropped"]


def deepseek_v3_router(hf: PretrainedConfig) -> RouterConfig:
    """The V3 router of a config with n_routed_experts, n_group, topk_group, norm_topk_prob, routed_scaling_factor."""
    return RouterConfig(
        hf.n_routed_experts,
        hf.num_experts_per_tok,
        "sigmoid",
        topk_norm=1.0 if hf.norm_topk_prob else None,
        num_groups=hf.n_group or 1,
        topk_groups=hf.topk_group or 1,
        group_score="top2_sum",
        correction_bias=True,
        scaling_factor=hf.routed_scaling_factor,
        float32=True,
    )


def deepseek_v2_router(hf: PretrainedConfig) -> RouterConfig:
    """The V2 router: softmax, `topk_method` greedy or group_limited_greedy, routed_scaling_factor."""
    grouped = hf.topk_method == "group_limited_greedy"
    return RouterConfig(
        hf.n_routed_experts,
        hf.num_experts_per_tok,
        num_groups=hf.n_group if grouped else 1,
        topk_groups=hf.topk_group if grouped else 1,
        scaling_factor=hf.routed_scaling_factor,
        float32=True,
    )


def deepseek_moe(hf: PretrainedConfig, router: RouterConfig) -> MoEConfig:
    """Routed experts of `moe_intermediate_size` and `n_shared_experts` shared ones."""
    size = hf.moe_intermediate_size
    return MoEConfig(router, size, hf.hidden_act, shared_intermediate_size=(hf.n_shared_experts or 0) * size)


def first_k_dense(hf: PretrainedConfig, layers: tuple[LayerConfig, ...]) -> tuple[LayerConfig, ...]:
    """The mixture of experts on every layer from `first_k_dense_replace` on."""
    return moe_layers(layers, lambda i: i >= hf.first_k_dense_replace)


def next_layer_dropped(hf: PretrainedConfig) -> CheckpointNames:
    """Transformers' names, without the multi-token-prediction layer stored after the last layer (as
    transformers drops it: `model.layers.<num_hidden_layers>`; speculative decoding would use it)."""
    return CheckpointNames(ignored_prefixes=(f"model.layers.{hf.num_hidden_layers}",))
