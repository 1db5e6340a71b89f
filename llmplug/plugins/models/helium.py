"""Helium (Kyutai): the Llama decoder with interleaved (GPT-J style) rotary, bias on q/k/v only when
`attention_bias`, never on the output projection. Checkpoint names are transformers' Llama names."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.plugins.models.arch_config import layers_of
from llmplug.plugins.models.llama import llama_fields

__all__ = ["HeliumForCausalLM"]


def helium_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """HeliumForCausalLM."""
    fields = llama_fields(hf) | {"layers": layers_of(hf, is_neox_style=False)}
    return DecoderArchConfig(**fields, qkv_bias=bool(hf.attention_bias))


class HeliumForCausalLM(DecoderForCausalLM):
    """Helium (HF architecture HeliumForCausalLM)."""

    arch_config_of = staticmethod(helium_arch_config)
