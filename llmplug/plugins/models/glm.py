"""GLM (GLM-4-9B-0414's predecessor `glm`) and GLM-4 (`glm4`): the Llama decoder with gate and up stored fused
(`gate_up_proj`, as Phi-3), bias on q/k/v only, and interleaved (GPT-J style) rotary over part of each head.
GLM-4 adds a norm after each sublayer (sandwich norms, with its own names)."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import GATE_UP, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.plugins.models.arch_config import layers_of
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Glm4ForCausalLM", "GlmForCausalLM"]

GLM_NAMES = CheckpointNames(fused={"mlp.gate_up_proj": GATE_UP})
# GLM-4's norm around each sublayer: theirs -> the decoder's sandwich names
GLM4_NAMES = CheckpointNames(
    renames={
        "post_self_attn_layernorm": "post_attention_layernorm",
        "post_attention_layernorm": "pre_feedforward_layernorm",
        "post_mlp_layernorm": "post_feedforward_layernorm",
    },
    fused={"mlp.gate_up_proj": GATE_UP},
)


def glm_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GlmForCausalLM."""
    fields = llama_fields(hf) | {"layers": layers_of(hf, is_neox_style=False)}
    return DecoderArchConfig(**fields, qkv_bias=bool(hf.attention_bias))


def glm4_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Glm4ForCausalLM: GLM with a norm before and after each sublayer."""
    fields = llama_fields(hf) | {"layers": layers_of(hf, is_neox_style=False)}
    return DecoderArchConfig(**fields, qkv_bias=bool(hf.attention_bias), post_norm=True)


class GlmForCausalLM(DecoderForCausalLM):
    """GLM-4 (first release; HF architecture GlmForCausalLM)."""

    arch_config_of = staticmethod(glm_arch_config)
    checkpoint_names = GLM_NAMES


class Glm4ForCausalLM(DecoderForCausalLM):
    """GLM-4-0414 (HF architecture Glm4ForCausalLM)."""

    arch_config_of = staticmethod(glm4_arch_config)
    checkpoint_names = GLM4_NAMES
