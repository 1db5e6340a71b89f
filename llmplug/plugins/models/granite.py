"""Granite (IBM Granite 3.x dense), Granite SWA and HyperCLOVA X: the Llama decoder with four multipliers —
embeddings, sublayer outputs before the residual add, attention scale, and logits.

Granite divides the logits by `logits_scaling`; HyperCLOVA X multiplies them, and adds a norm after each
sublayer (Peri-LN, `use_post_norm`). Granite SWA adds windowed layers, learned attention sinks and a rope
base per layer (`layer_rope_theta`, 0: no rotary)."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.plugins.models.llama import llama_fields

__all__ = ["GraniteForCausalLM", "GraniteSWAForCausalLM", "HyperCLOVAXForCausalLM"]

# HyperCLOVA X with Peri-LN: theirs -> the decoder's sandwich names
HYPERCLOVAX_PERI_LN_NAMES = CheckpointNames(
    renames={
        "post_norm1": "post_attention_layernorm",
        "post_attention_layernorm": "pre_feedforward_layernorm",
        "post_norm2": "post_feedforward_layernorm",
    }
)
GRANITE_SWA_NAMES = CheckpointNames(renames={"self_attn.sinks": "self_attn.attn.sinks"})


def granite_fields(hf: PretrainedConfig) -> dict[str, Any]:
    """The Llama fields, biases and Granite's multipliers but the logits'."""
    bias = bool(hf.attention_bias)
    return llama_fields(hf) | dict(
        qkv_bias=bias,
        o_proj_bias=bias,
        attention_scale=hf.attention_multiplier,
        embedding_multiplier=hf.embedding_multiplier,
        residual_multiplier=hf.residual_multiplier,
    )


def granite_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GraniteForCausalLM."""
    return DecoderArchConfig(**granite_fields(hf), logits_multiplier=1.0 / hf.logits_scaling)


def _layer_rope_thetas(hf: PretrainedConfig, layers: tuple[LayerConfig, ...]) -> tuple[LayerConfig, ...]:
    """Each layer's rope with its `layer_rope_theta` base; none where that is 0."""
    return tuple(
        dataclasses.replace(layer, rope=dataclasses.replace(layer.rope, theta=float(theta)) if theta else None)
        for layer, theta in zip(layers, hf.layer_rope_theta, strict=True)
    )


def granite_swa_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GraniteSWAForCausalLM."""
    fields = granite_fields(hf)
    fields["layers"] = _layer_rope_thetas(hf, fields["layers"])
    return DecoderArchConfig(**fields, attention_sinks=True, logits_multiplier=1.0 / hf.logits_scaling)


def hyperclovax_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """HyperCLOVAXForCausalLM."""
    return DecoderArchConfig(
        **granite_fields(hf), post_norm=bool(hf.use_post_norm), logits_multiplier=hf.logits_scaling
    )


def hyperclovax_checkpoint_names(hf: PretrainedConfig) -> CheckpointNames:
    """The sandwich names with Peri-LN, else transformers' Llama names."""
    return HYPERCLOVAX_PERI_LN_NAMES if hf.use_post_norm else CheckpointNames()


class GraniteForCausalLM(DecoderForCausalLM):
    """Granite (HF architecture GraniteForCausalLM)."""

    arch_config_of = staticmethod(granite_arch_config)


class GraniteSWAForCausalLM(DecoderForCausalLM):
    """Granite with sliding-window layers and attention sinks (HF architecture GraniteSWAForCausalLM)."""

    arch_config_of = staticmethod(granite_swa_arch_config)
    checkpoint_names = GRANITE_SWA_NAMES


class HyperCLOVAXForCausalLM(DecoderForCausalLM):
    """HyperCLOVA X SEED (HF architecture HyperCLOVAXForCausalLM)."""

    arch_config_of = staticmethod(hyperclovax_arch_config)
    checkpoint_names_of = staticmethod(hyperclovax_checkpoint_names)
