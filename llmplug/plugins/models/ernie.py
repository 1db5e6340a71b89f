"""ERNIE 4.5 (dense): the Llama decoder with interleaved (GPT-J style) rotary and one `use_bias` switch for
every projection. Checkpoint names are transformers' Llama names."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.plugins.models.arch_config import layers_of
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Ernie4_5ForCausalLM"]


def ernie4_5_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Ernie4_5ForCausalLM."""
    bias = bool(hf.use_bias)
    fields = llama_fields(hf) | {"layers": layers_of(hf, is_neox_style=False), "mlp": MLPConfig(hf.hidden_act, bias=bias)}
    return DecoderArchConfig(**fields, qkv_bias=bias, o_proj_bias=bias)


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    """ERNIE 4.5 dense models (HF architecture Ernie4_5ForCausalLM)."""

    arch_config_of = staticmethod(ernie4_5_arch_config)
