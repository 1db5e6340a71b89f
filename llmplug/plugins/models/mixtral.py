"""Mixtral and Phi-3.5-MoE: Llama / Phi-3 attention with a mixture of experts on every layer.

Mixtral's router: softmax over the experts, top-k, weights renormalised to sum to one. Phi-3.5-MoE's
router is the sparsemixer (two masked softmaxes), with LayerNorms and biases. Both store experts one
by one as `block_sparse_moe.experts.<e>.w1/w2/w3` (gate, down, up).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.plugins.models.arch_config import moe_layers
from llmplug.plugins.models.llama import llama_fields

__all__ = ["MIXTRAL_NAMES", "MixtralForCausalLM", "PhimoeForCausalLM"]

MIXTRAL_NAMES = CheckpointNames(
    renames={"block_sparse_moe": "mlp", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
)


def mixtral_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """MixtralForCausalLM: every layer a mixture of `num_local_experts` SiLU experts, top-k renormalised."""
    router = RouterConfig(hf.num_local_experts, hf.num_experts_per_tok, topk_norm=1.0)
    fields = llama_fields(hf)
    return DecoderArchConfig(
        **fields | {"layers": moe_layers(fields["layers"])},
        moe=MoEConfig(router, hf.intermediate_size, hf.hidden_act),
    )


def phimoe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """PhimoeForCausalLM: sparsemixer top-2, LayerNorm with bias, attention and lm_head biases."""
    router = RouterConfig(
        hf.num_local_experts, hf.num_experts_per_tok, scoring="sparsemixer", sparsemixer_eps=hf.router_jitter_noise
    )
    fields = llama_fields(hf, NormConfig("layer", hf.rms_norm_eps, bias=True))
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **fields | {"layers": moe_layers(fields["layers"])},
        moe=MoEConfig(router, hf.intermediate_size, hf.hidden_act),
        qkv_bias=bias,
        o_proj_bias=bias,
        lm_head_bias=bool(hf.lm_head_bias),
    )


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral (HF architecture MixtralForCausalLM)."""

    arch_config_of = staticmethod(mixtral_arch_config)
    checkpoint_names = MIXTRAL_NAMES


class PhimoeForCausalLM(DecoderForCausalLM):
    """Phi-3.5-MoE (HF architecture PhimoeForCausalLM)."""

    arch_config_of = staticmethod(phimoe_arch_config)
    checkpoint_names = MIXTRAL_NAMES
