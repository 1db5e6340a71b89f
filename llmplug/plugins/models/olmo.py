"""OLMo, OLMo 2 and OLMo 3.

OLMo: the Llama decoder with a LayerNorm that has no weight and no bias, and q/k/v clamped to
`clip_qkv`. OLMo 2: RMSNorm after each sublayer instead of before it, and RMSNorm over the whole
q and k projections (all heads at once). OLMo 3: OLMo 2 with sliding-window layers, each layer type
with its own rope. Checkpoint names are transformers' Llama names.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoForCausalLM"]

OLMO_LAYER_NORM_EPS = 1e-5  # fixed in transformers' OlmoLayerNorm


def olmo_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """OlmoForCausalLM."""
    bias = bool(hf.attention_bias)
    fields = llama_fields(hf, NormConfig("layer", OLMO_LAYER_NORM_EPS, has_weight=False))
    return DecoderArchConfig(**fields, qkv_bias=bias, o_proj_bias=bias, clip_qkv=hf.clip_qkv)


def olmo2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Olmo2ForCausalLM; also Olmo3ForCausalLM, whose layer types (windows, ropes) layers_of reads."""
    bias = bool(hf.attention_bias)
    qk_norm = QKNormConfig(NormConfig("rms", hf.rms_norm_eps), scope="projection")
    return DecoderArchConfig(
        **llama_fields(hf), qkv_bias=bias, o_proj_bias=bias, qk_norm=qk_norm, pre_norm=False, post_norm=True
    )


class OlmoForCausalLM(DecoderForCausalLM):
    """OLMo (HF architecture OlmoForCausalLM)."""

    arch_config_of = staticmethod(olmo_arch_config)


class Olmo2ForCausalLM(DecoderForCausalLM):
    """OLMo 2 (HF architecture Olmo2ForCausalLM)."""

    arch_config_of = staticmethod(olmo2_arch_config)


class Olmo3ForCausalLM(DecoderForCausalLM):
    """OLMo 3 (HF architecture Olmo3ForCausalLM)."""

    arch_config_of = staticmethod(olmo2_arch_config)
