"""DeepSeek V2 and V3: multi-head latent attention (llmplug.layers.decoder.mla) and DeepSeek's mixture of experts.

Both: the first `first_k_dense_replace` layers keep a dense MLP of `intermediate_size`, the rest have
`n_routed_experts` experts plus `n_shared_experts` shared ones (deepseek_moe.py). V2 routes by softmax
(greedy or group-limited), V3 by sigmoid with a score-correction bias and grouped top-k. The rotary
(over qk_rope_head_dim, interleaved pairs unless V3's `rope_interleave` is off) may be YaRN; with its
`mscale_all_dim` the attention scale is multiplied by mscale^2, as DeepSeek does.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLAConfig, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import RouterConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of
from llmplug.plugins.models.deepseek_moe import (
    deepseek_moe,
    deepseek_v2_router,
    deepseek_v3_router,
    first_k_dense,
    next_layer_dropped,
)

__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "mla_config_of", "mla_scale"]

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


def deepseek_fields(hf: PretrainedConfig, router: RouterConfig, interleaved: bool) -> dict[str, Any]:
    """The DecoderArchConfig fields DeepSeek V2 and V3 share."""
    layers = layers_of(hf, is_neox_style=not interleaved)
    return dict(
        **sizes_of(hf),
        layers=first_k_dense(hf, layers),
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


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V2 / V2-Lite (HF architecture DeepseekV2ForCausalLM)."""

    arch_config_of = staticmethod(deepseek_v2_arch_config)


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V3 / R1 (HF architecture DeepseekV3ForCausalLM)."""

    arch_config_of = staticmethod(deepseek_v3_arch_config)
    checkpoint_names_of = staticmethod(next_layer_dropped)
