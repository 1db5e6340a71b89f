"""GPT-NeoX (Pythia, GPT-NeoX-20B, RedPajama-INCITE, ...) and GPT-NeoX-Japanese.

LayerNorm, partial rotary, GELU MLP, q/k/v fused per head in the checkpoint; attention and MLP
read two separate norms of the same input in parallel (`use_parallel_residual`, else sequential).
GPT-NeoX-Japanese: sequential, no biases but one on the last layer's attention output (`dense_bias`).
"""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import QKV_PER_HEAD, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["GPTNeoXForCausalLM", "GPTNeoXJapaneseForCausalLM"]

GPT_NEOX_NAMES = CheckpointNames(
    prefixes={
        "gpt_neox.embed_in": "model.embed_tokens",
        "gpt_neox.layers": "model.layers",
        "gpt_neox.final_layer_norm": "model.norm",
        "embed_out": "lm_head",  # the name before transformers 5
    },
    renames={
        "attention.query_key_value": "self_attn.qkv_proj",
        "attention.dense": "self_attn.o_proj",
        "mlp.dense_h_to_4h": "mlp.up_proj",
        "mlp.dense_4h_to_h": "mlp.down_proj",
    },
    fused={"self_attn.qkv_proj": QKV_PER_HEAD},
    ignored=("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq"),
)


def gpt_neox_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GPTNeoXForCausalLM."""
    parallel = bool(hf.use_parallel_residual)
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=NormConfig("layer", hf.layer_norm_eps, bias=True),
        mlp=MLPConfig(hf.hidden_act, gated=False, bias=True),
        qkv_bias=bias,
        o_proj_bias=bias,
        parallel_residual=parallel,
        parallel_mlp_norm=parallel,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


_JAPANESE_TOP = {"embed_in": "model.embed_tokens", "layers": "model.layers", "final_layer_norm": "model.norm"}
GPT_NEOX_JAPANESE_NAMES = dataclasses.replace(
    GPT_NEOX_NAMES,
    prefixes={**{f"gpt_neox_japanese.{k}": v for k, v in _JAPANESE_TOP.items()}, "embed_out": "lm_head"},
    renames={**GPT_NEOX_NAMES.renames, "attention.dense_bias": "self_attn.o_proj.bias"},
)


def gpt_neox_japanese_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GPTNeoXJapaneseForCausalLM."""
    layers = layers_of(hf)
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=int(hf.hidden_size * hf.intermediate_multiple_size)),
        layers=(*layers[:-1], dataclasses.replace(layers[-1], o_proj_bias=True)),
        norm=NormConfig("layer", hf.layer_norm_eps, bias=True),
        mlp=MLPConfig(hf.hidden_act, gated=False),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class GPTNeoXForCausalLM(DecoderForCausalLM):
    """GPT-NeoX (HF architecture GPTNeoXForCausalLM)."""

    arch_config_of = staticmethod(gpt_neox_arch_config)
    checkpoint_names = GPT_NEOX_NAMES


class GPTNeoXJapaneseForCausalLM(DecoderForCausalLM):
    """GPT-NeoX-Japanese (HF architecture GPTNeoXJapaneseForCausalLM)."""

    arch_config_of = staticmethod(gpt_neox_japanese_arch_config)
    checkpoint_names = GPT_NEOX_JAPANESE_NAMES
