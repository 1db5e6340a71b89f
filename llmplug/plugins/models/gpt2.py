"""GPT-2 and GPT-BigCode (StarCoder 1, SantaCoder): learned absolute positions, LayerNorm, GELU MLP, q/k/v
fused in one `c_attn`. GPT-2 stores Conv1D weights ([in, out]); GPT-BigCode plain linear weights and, when
`multi_query`, one KV head (`[q | k | v]`), else q/k/v per head. Hub checkpoints (openai-community/gpt2) lack
the `transformer.` prefix; both spellings load."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import QKV_CONTIGUOUS, QKV_PER_HEAD, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, refuse, sizes_of

__all__ = ["GPT2LMHeadModel", "GPTBigCodeForCausalLM"]

_TOP = {"wte": "model.embed_tokens", "wpe": "model.embed_positions", "h": "model.layers", "ln_f": "model.norm"}
GPT2_NAMES = CheckpointNames(
    prefixes={**_TOP, **{f"transformer.{k}": v for k, v in _TOP.items()}},
    renames={
        "ln_1": "input_layernorm",
        "ln_2": "post_attention_layernorm",
        "attn.c_attn": "self_attn.qkv_proj",
        "attn.c_proj": "self_attn.o_proj",
        "mlp.c_fc": "mlp.up_proj",
        "mlp.c_proj": "mlp.down_proj",
    },
    transposed=frozenset({"self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"}),
    fused={"self_attn.qkv_proj": QKV_CONTIGUOUS},
    ignored=("attn.bias", "attn.masked_bias"),
)


def gpt2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GPT2LMHeadModel."""
    refuse(hf, bool(hf.scale_attn_by_inverse_layer_idx), "scale_attn_by_inverse_layer_idx")
    return DecoderArchConfig(**gpt2_fields(hf))


def gpt2_fields(hf: PretrainedConfig) -> dict[str, Any]:
    """What GPT-2 and GPT-BigCode share."""
    refuse(hf, bool(getattr(hf, "add_cross_attention", False)), "add_cross_attention")
    sizes = sizes_of(hf, intermediate_size=hf.n_inner or 4 * hf.hidden_size)
    return dict(
        **sizes,
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", hf.layer_norm_epsilon, bias=True),
        mlp=MLPConfig(hf.activation_function, gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        attention_scale=None if hf.scale_attn_weights else 1.0,
        absolute_positions="learned",
        max_position=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


def gpt_bigcode_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GPTBigCodeForCausalLM: GPT-2 with one KV head when `multi_query`."""
    return DecoderArchConfig(**gpt2_fields(hf) | {"num_kv_heads": 1 if hf.multi_query else hf.num_attention_heads})


def gpt_bigcode_checkpoint_names(hf: PretrainedConfig) -> CheckpointNames:
    """GPT-2's names on plain linear weights; `c_attn` is [q | k | v] with one KV head, else per head."""
    return dataclasses.replace(
        GPT2_NAMES,
        transposed=frozenset(),
        fused={"self_attn.qkv_proj": QKV_CONTIGUOUS if hf.multi_query else QKV_PER_HEAD},
    )


class GPT2LMHeadModel(DecoderForCausalLM):
    """GPT-2, DistilGPT-2 (HF architecture GPT2LMHeadModel)."""

    arch_config_of = staticmethod(gpt2_arch_config)
    checkpoint_names = GPT2_NAMES


class GPTBigCodeForCausalLM(DecoderForCausalLM):
    """GPT-BigCode: StarCoder 1, SantaCoder (HF architecture GPTBigCodeForCausalLM)."""

    arch_config_of = staticmethod(gpt_bigcode_arch_config)
    checkpoint_names_of = staticmethod(gpt_bigcode_checkpoint_names)
