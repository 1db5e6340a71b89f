"""Jais 2: the Llama decoder with LayerNorm (with bias) instead of RMSNorm, a plain squared-ReLU MLP and
biases on attention and MLP. Checkpoint names are transformers' Llama names."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["Jais2ForCausalLM"]


def jais2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Jais2ForCausalLM."""
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=NormConfig("layer", hf.layer_norm_eps, bias=True),
        mlp=MLPConfig(hf.hidden_act, gated=False, bias=bool(hf.mlp_bias)),
        qkv_bias=bias,
        o_proj_bias=bias,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class Jais2ForCausalLM(DecoderForCausalLM):
    """Jais 2 (HF architecture Jais2ForCausalLM)."""

    arch_config_of = staticmethod(jais2_arch_config)
