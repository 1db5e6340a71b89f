"""Arcee (AFM-4.5B): the Llama decoder with a plain (non-gated) squared-ReLU MLP, `up_proj` then `down_proj`,
as Nemotron's. Checkpoint names are transformers' Llama names."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.plugins.models.llama import llama_fields

__all__ = ["ArceeForCausalLM"]


def arcee_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """ArceeForCausalLM."""
    bias = bool(hf.attention_bias)
    mlp = MLPConfig(hf.hidden_act, gated=False, bias=bool(hf.mlp_bias))
    return DecoderArchConfig(**llama_fields(hf) | {"mlp": mlp}, qkv_bias=bias, o_proj_bias=bias)


class ArceeForCausalLM(DecoderForCausalLM):
    """Arcee AFM (HF architecture ArceeForCausalLM)."""

    arch_config_of = staticmethod(arcee_arch_config)
