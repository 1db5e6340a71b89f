"""GPT-Neo: learned positions, LayerNorm, GELU MLP, unscaled attention scores (no 1/sqrt(d)), and
layers alternating global and local (sliding-window) attention as `attention_layers` lists them."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import sizes_of

__all__ = ["GPTNeoForCausalLM"]

GPT_NEO_NAMES = CheckpointNames(
    prefixes={
        "transformer.wte": "model.embed_tokens",
        "transformer.wpe": "model.embed_positions",
        "transformer.h": "model.layers",
        "transformer.ln_f": "model.norm",
    },
    renames={
        "ln_1": "input_layernorm",
        "ln_2": "post_attention_layernorm",
        "attn.attention": "self_attn",
        "out_proj": "o_proj",
        "mlp.c_fc": "mlp.up_proj",
        "mlp.c_proj": "mlp.down_proj",
    },
    ignored=("attn.attention.bias", "attn.attention.masked_bias"),
)


def gpt_neo_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GPTNeoForCausalLM."""
    windows = {"global": None, "local": hf.window_size}
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=hf.intermediate_size or 4 * hf.hidden_size),
        layers=tuple(LayerConfig(None, windows[kind]) for kind in hf.attention_layers),
        norm=NormConfig("layer", hf.layer_norm_epsilon, bias=True),
        mlp=MLPConfig(hf.activation_function, gated=False, bias=True),
        o_proj_bias=True,
        attention_scale=1.0,
        absolute_positions="learned",
        max_position=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class GPTNeoForCausalLM(DecoderForCausalLM):
    """GPT-Neo (HF architecture GPTNeoForCausalLM)."""

    arch_config_of = staticmethod(gpt_neo_arch_config)
    checkpoint_names = GPT_NEO_NAMES
