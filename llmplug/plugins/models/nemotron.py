"""Nemotron (Nemotron-3, Minitron): LayerNorm with `1 + w` scale (layernorm1p), partial rotary,
a plain squared-ReLU MLP (up_proj, down_proj). Checkpoint names are transformers' Llama names."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["NemotronForCausalLM"]


def nemotron_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """NemotronForCausalLM."""
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=NormConfig("layer", hf.norm_eps, bias=True, weight_offset=1.0),
        mlp=MLPConfig(hf.hidden_act, gated=False, bias=bool(hf.mlp_bias)),
        qkv_bias=bias,
        o_proj_bias=bias,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class NemotronForCausalLM(DecoderForCausalLM):
    """Nemotron (HF architecture NemotronForCausalLM)."""

    arch_config_of = staticmethod(nemotron_arch_config)
