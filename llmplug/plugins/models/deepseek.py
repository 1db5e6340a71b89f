"""DeepSeek V2 and V3: multi-head latent attention (llmplug.layers.decoder.mla) and DeepSeek's mixture of experts.

Both: the first `first_k_dense_replace` layers keep a dense MLP of `intermediate_size`, the rest have
`n_routed_experts` experts plus `n_shared_experts` shared ones (deepseek_moe.py). V2 routes by softmax
(greedy or group-limited), V3 by sigmoid with a score-correction bias and grouped top-k. The rotary
(over qk_rope_head_dim, interleaved pairs unless V3's `rope_interleave` is off) may be YaRN; with its
`mscale_all_dim` the attention scale is multiplied by mscale^2, as DeepSeek does.

Also here, being DeepSeek V3 with one difference each: GLM-4.7-Flash (Glm4MoeLite: MoE layers named by
`mlp_layer_types`) and Youtu-LLM (V3's latent attention in the Llama decoder with a dense MLP).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLAConfig, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import RouterConfig
from llmplug.plugins.models.arch_config import layers_of, moe_layers, sizes_of
from llmplug.plugins.models.deepseek_moe import (
    deepseek_moe,
    deepseek_v2_router,
    deepseek_v3_router,
    first_k_dense,
    next_layer_dropped,
)
from llmplug.plugins.models.llama import llama_fields

__all__ = [
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "YoutuForCausalLM",
    "mla_config_of",
    "mla_scale",
]

LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek q_a_layernorm / kv_a_layernorm use the RMSNorm default


def mla_config_of(hf: PretrainedConfig) -> MLAConfig:
    """The latent-attention sizes of a DeepSeek-style config."""
    return MLAConfig(
        hf.kv_lora_rank,
        hf.qk_nope_head_dim,
        hf.qk_rope_head_dim,
        hf.v_head_dim,
        hf.q_lora_rank,
        LATENT_NORM_EPS,
        latent_bias=bool(getattr(hf, "attention_bias", False)),
    )


def mla_scale(hf: PretrainedConfig) -> float:
    """qk_head_dim^-0.5, times mscale^2 of a scaled rope with `mscale_all_dim` (YaRN's temperature)."""
    scale = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def deepseek_fields(
    hf: PretrainedConfig, router: RouterConfig, interleaved: bool, is_moe: Callable[[int], bool] | None = None
) -> dict[str, Any]:
    """The DecoderArchConfig fields DeepSeek V2 and V3 share; MoE layers from `first_k_dense_replace` on
    unless `is_moe` says which."""
    layers = layers_of(hf, is_neox_style=not interleaved)
    return dict(
        **sizes_of(hf),
        layers=first_k_dense(hf, layers) if is_moe is None else moe_layers(layers, is_moe),
        norm=NormConfig("rms", hf.rms_norm_eps),
        mlp=MLPConfig(hf.hidden_act, bias=bool(getattr(hf, "mlp_bias", False))),
        moe=deepseek_moe(hf, router),
        mla=mla_config_of(hf),
        attention_scale=mla_scale(hf),
        o_proj_bias=bool(getattr(hf, "attention_bias", False)),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


def deepseek_v2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """DeepseekV2ForCausalLM: interleaved rotary, V2 routing."""
    return DecoderArchConfig(**deepseek_fields(hf, deepseek_v2_router(hf), interleaved=True))


def deepseek_v3_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """DeepseekV3ForCausalLM: V3 routing, interleaved rotary unless `rope_interleave` is off."""
    return DecoderArchConfig(**deepseek_fields(hf, deepseek_v3_router(hf), interleaved=bool(hf.rope_interleave)))


def glm4_moe_lite_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Glm4MoeLiteForCausalLM: DeepSeek V3 with its MoE layers named by `mlp_layer_types`."""
    is_moe = lambda i: hf.mlp_layer_types[i] == "sparse"  # noqa: E731
    return DecoderArchConfig(
        **deepseek_fields(hf, deepseek_v3_router(hf), interleaved=bool(hf.rope_interleave), is_moe=is_moe)
    )


def youtu_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """YoutuForCausalLM: DeepSeek V3's latent attention in the Llama decoder with a dense MLP."""
    return DecoderArchConfig(
        **llama_fields(hf) | {"layers": layers_of(hf, is_neox_style=not hf.rope_interleave)},
        mla=mla_config_of(hf),
        attention_scale=mla_scale(hf),
        o_proj_bias=bool(hf.attention_bias),
    )


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V2 / V2-Lite (HF architecture DeepseekV2ForCausalLM)."""

    arch_config_of = staticmethod(deepseek_v2_arch_config)


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V3 / R1 (HF architecture DeepseekV3ForCausalLM)."""

    arch_config_of = staticmethod(deepseek_v3_arch_config)
    checkpoint_names_of = staticmethod(next_layer_dropped)


class Glm4MoeLiteForCausalLM(DecoderForCausalLM):
    """GLM-4.7-Flash (HF architecture Glm4MoeLiteForCausalLM)."""

    arch_config_of = staticmethod(glm4_moe_lite_arch_config)
    checkpoint_names_of = staticmethod(next_layer_dropped)


class YoutuForCausalLM(DecoderForCausalLM):
    """Youtu-LLM (HF architecture YoutuForCausalLM)."""

    arch_config_of = staticmethod(youtu_arch_config)
