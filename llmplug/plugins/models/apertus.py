"""Apertus: the Llama decoder with a plain MLP under xIELU (a learned activation, `mlp.act_fn.*`), RMSNorm on
each q and k head, and its own names for the two layer norms."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.llama import llama_fields

__all__ = ["ApertusForCausalLM"]

APERTUS_NAMES = CheckpointNames(
    renames={"attention_layernorm": "input_layernorm", "feedforward_layernorm": "post_attention_layernorm"}
)


def apertus_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """ApertusForCausalLM."""
    bias = bool(hf.attention_bias)
    norm = NormConfig("rms", hf.rms_norm_eps)
    mlp = MLPConfig(hf.hidden_act, gated=False)
    return DecoderArchConfig(
        **llama_fields(hf) | {"mlp": mlp}, qkv_bias=bias, o_proj_bias=bias, qk_norm=QKNormConfig(norm)
    )


class ApertusForCausalLM(DecoderForCausalLM):
    """Apertus (HF architecture ApertusForCausalLM)."""

    arch_config_of = staticmethod(apertus_arch_config)
    checkpoint_names = APERTUS_NAMES
