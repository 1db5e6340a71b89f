"""GPT-1 (openai-community/openai-gpt): GPT-2's layer with the LayerNorm after each residual add (post-LN), no
final norm, learned positions. Its tensor names are GPT-2's inside the layers (Conv1D weights, fused `c_attn`);
hub checkpoints lack the `transformer.` prefix, both spellings load."""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, refuse, sizes_of
from llmplug.plugins.models.gpt2 import GPT2_NAMES

__all__ = ["OpenAIGPTLMHeadModel"]

_TOP = {"tokens_embed": "model.embed_tokens", "positions_embed": "model.embed_positions", "h": "model.layers"}
OPENAI_GPT_NAMES = dataclasses.replace(
    GPT2_NAMES, prefixes={**_TOP, **{f"transformer.{k}": v for k, v in _TOP.items()}}
)
ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu", "silu": "silu", "swish": "silu"}  # its `afn` names


def openai_gpt_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """OpenAIGPTLMHeadModel."""
    refuse(hf, hf.afn not in ACTIVATIONS, f"afn={hf.afn!r}")
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=4 * hf.hidden_size),
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", hf.layer_norm_epsilon, bias=True),
        mlp=MLPConfig(ACTIVATIONS[hf.afn], gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        pre_norm=False,
        norm_after_residual=True,
        absolute_positions="learned",
        max_position=hf.max_position_embeddings,
        final_norm=False,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class OpenAIGPTLMHeadModel(DecoderForCausalLM):
    """GPT-1 (HF architecture OpenAIGPTLMHeadModel)."""

    arch_config_of = staticmethod(openai_gpt_arch_config)
    checkpoint_names = OPENAI_GPT_NAMES
