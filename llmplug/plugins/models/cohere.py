"""Cohere (Command R, Command R+) and Cohere 2 (Command R7B, Command A).

Cohere: one bias-free LayerNorm feeding attention and MLP in parallel, interleaved (GPT-J style) rotary,
logits scaled by `logit_scale`, optional per-head LayerNorm on q and k with a weight row per head.
Cohere 2: no q/k norm; windowed layers with rotary interleaved with global layers without (NoPE).
Checkpoint names are transformers' Llama names."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import SLIDING, layers_of, sizes_of

__all__ = ["Cohere2ForCausalLM", "CohereForCausalLM"]


def cohere_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """CohereForCausalLM."""
    norm = NormConfig("layer", hf.layer_norm_eps)
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf, is_neox_style=False),
        norm=norm,
        mlp=MLPConfig(hf.hidden_act),
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=QKNormConfig(norm, scope="per_head") if hf.use_qk_norm else None,
        parallel_residual=True,
        logits_multiplier=hf.logit_scale,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


def cohere2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Cohere2ForCausalLM: rotary only in the windowed layers (none at all without a `sliding_window`)."""
    nope = {i for i, kind in enumerate(hf.layer_types) if kind != SLIDING or not hf.sliding_window}
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf, is_neox_style=False, nope_layers=nope),
        norm=NormConfig("layer", hf.layer_norm_eps),
        mlp=MLPConfig(hf.hidden_act),
        qkv_bias=bias,
        o_proj_bias=bias,
        parallel_residual=True,
        logits_multiplier=hf.logit_scale,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class CohereForCausalLM(DecoderForCausalLM):
    """Cohere Command R (HF architecture CohereForCausalLM)."""

    arch_config_of = staticmethod(cohere_arch_config)


class Cohere2ForCausalLM(DecoderForCausalLM):
    """Cohere 2: Command R7B, Command A (HF architecture Cohere2ForCausalLM)."""

    arch_config_of = staticmethod(cohere2_arch_config)
