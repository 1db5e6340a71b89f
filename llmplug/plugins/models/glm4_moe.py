"""GLM-4.5 / 4.6 (Glm4Moe), dots.llm1 (Dots1) and Solar Open: grouped-query attention with DeepSeek V3's
mixture of experts.

Glm4Moe: partial rotary (half of each head), q/k/v bias (`attention_bias`, o_proj without), optional
per-head q/k RMSNorm (`use_qk_norm`). Dots1: Qwen3's attention (per-head q/k RMSNorm), windows by layer
type. Both keep the first `first_k_dense_replace` layers dense. Checkpoint names are transformers';
GLM-4.5's multi-token-prediction layer (after the last layer) is dropped, as transformers does.
Solar Open: Llama's attention (q/k/v bias without o_proj's) and experts on every layer.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.deepseek_moe import deepseek_moe, deepseek_v3_router, first_k_dense, next_layer_dropped
from llmplug.plugins.models.arch_config import layers_of, moe_layers, sizes_of
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Dots1ForCausalLM", "Glm4MoeForCausalLM", "SolarOpenForCausalLM"]


def glm4_moe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Glm4MoeForCausalLM."""
    fields = llama_fields(hf)
    qk_norm = QKNormConfig(NormConfig("rms", hf.rms_norm_eps)) if hf.use_qk_norm else None
    return DecoderArchConfig(
        **fields | {"layers": first_k_dense(hf, fields["layers"])},
        moe=deepseek_moe(hf, deepseek_v3_router(hf)),
        qkv_bias=bool(hf.attention_bias),
        qk_norm=qk_norm,
    )


def dots1_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Dots1ForCausalLM."""
    fields = llama_fields(hf)
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **fields | {"layers": first_k_dense(hf, fields["layers"])},
        moe=deepseek_moe(hf, deepseek_v3_router(hf)),
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=QKNormConfig(NormConfig("rms", hf.rms_norm_eps)),
    )


def solar_open_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """SolarOpenForCausalLM: Llama attention (biases on q/k/v only), DeepSeek V3's experts on every layer."""
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=hf.moe_intermediate_size),  # no dense MLP: every layer has experts
        layers=moe_layers(layers_of(hf)),
        norm=NormConfig("rms", hf.rms_norm_eps),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        moe=deepseek_moe(hf, deepseek_v3_router(hf)),
        qkv_bias=bool(hf.attention_bias),
    )


class Glm4MoeForCausalLM(DecoderForCausalLM):
    """GLM-4.5 / GLM-4.6 (HF architecture Glm4MoeForCausalLM)."""

    arch_config_of = staticmethod(glm4_moe_arch_config)
    checkpoint_names_of = staticmethod(next_layer_dropped)


class Dots1ForCausalLM(DecoderForCausalLM):
    """dots.llm1 (HF architecture Dots1ForCausalLM)."""

    arch_config_of = staticmethod(dots1_arch_config)


class SolarOpenForCausalLM(DecoderForCausalLM):
    """Solar Open (HF architecture SolarOpenForCausalLM)."""

    arch_config_of = staticmethod(solar_open_arch_config)
