"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 decoders with a mixture of experts on their sparse layers.

A layer is sparse unless it is in `mlp_only_layers` or its index + 1 is not a multiple of
`decoder_sparse_step`; the others keep a dense MLP of `intermediate_size`. Routers: softmax, top-k,
renormalised when `norm_topk_prob`. Qwen2-MoE adds a shared expert gated by sigmoid(x w).
Checkpoint names are transformers' (experts one by one, `shared_expert`).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import moe_layers
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "qwen_moe_fields"]


def qwen_moe_fields(hf: PretrainedConfig, shared_intermediate_size: int = 0) -> dict[str, Any]:
    """llama_fields with the sparse layers and their MoEConfig, as every Qwen-MoE config describes them."""
    router = RouterConfig(hf.num_experts, hf.num_experts_per_tok, topk_norm=1.0 if hf.norm_topk_prob else None)
    dense = set(hf.mlp_only_layers or ())
    step = hf.decoder_sparse_step
    fields = llama_fields(hf)
    return fields | dict(
        layers=moe_layers(fields["layers"], lambda i: i not in dense and hf.num_experts > 0 and (i + 1) % step == 0),
        moe=MoEConfig(
            router,
            hf.moe_intermediate_size,
            hf.hidden_act,
            shared_intermediate_size=shared_intermediate_size,
            shared_expert_gate=bool(shared_intermediate_size),
        ),
    )


def qwen2_moe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen2MoeForCausalLM: q/k/v bias (`qkv_bias`), a gated shared expert."""
    return DecoderArchConfig(
        **qwen_moe_fields(hf, hf.shared_expert_intermediate_size), qkv_bias=bool(getattr(hf, "qkv_bias", True))
    )


def qwen3_moe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen3MoeForCausalLM: RMSNorm on each q and k head, `attention_bias`."""
    bias = bool(hf.attention_bias)
    qk_norm = QKNormConfig(NormConfig("rms", hf.rms_norm_eps))
    return DecoderArchConfig(**qwen_moe_fields(hf), qkv_bias=bias, o_proj_bias=bias, qk_norm=qk_norm)


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE (HF architecture Qwen2MoeForCausalLM)."""

    arch_config_of = staticmethod(qwen2_moe_arch_config)
    checkpoint_names = CheckpointNames(renames={"shared_expert": "shared_experts"})


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE (HF architecture Qwen3MoeForCausalLM)."""

    arch_config_of = staticmethod(qwen3_moe_arch_config)
