"""Granite (IBM Granite 3.x dense): the Llama decoder with four multipliers — embeddings, sublayer
outputs before the residual add, attention scale, and logits (divided by `logits_scaling`)."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.plugins.models.llama import llama_fields

__all__ = ["GraniteForCausalLM"]


def granite_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GraniteForCausalLM."""
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **llama_fields(hf),
        qkv_bias=bias,
        o_proj_bias=bias,
        attention_scale=hf.attention_multiplier,
        embedding_multiplier=hf.embedding_multiplier,
        residual_multiplier=hf.residual_multiplier,
        logits_multiplier=1.0 / hf.logits_scaling,
    )


class GraniteForCausalLM(DecoderForCausalLM):
    """Granite (HF architecture GraniteForCausalLM)."""

    arch_config_of = staticmethod(granite_arch_config)
