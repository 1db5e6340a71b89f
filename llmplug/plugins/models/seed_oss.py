"""Seed-OSS: the Llama decoder with separate bias switches for q/k/v (`attention_bias`), the output projection
(`attention_out_bias`) and the MLP (`mlp_bias`). Checkpoint names are transformers' Llama names."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.plugins.models.llama import llama_fields

__all__ = ["SeedOssForCausalLM"]


def seed_oss_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """SeedOssForCausalLM."""
    return DecoderArchConfig(
        **llama_fields(hf), qkv_bias=bool(hf.attention_bias), o_proj_bias=bool(hf.attention_out_bias)
    )


class SeedOssForCausalLM(DecoderForCausalLM):
    """Seed-OSS (HF architecture SeedOssForCausalLM)."""

    arch_config_of = staticmethod(seed_oss_arch_config)
