"""NanoChat (karpathy/nanochat): RMSNorm without weights everywhere (after the embeddings too, and on each q and
k head after rotary), rotary turning the other way (a flipped `rotate_half`), a plain squared-ReLU MLP (`fc1`,
`fc2`) and a final logit soft-cap."""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["NanoChatForCausalLM"]

NANOCHAT_NAMES = CheckpointNames(renames={"mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj"})


def nanochat_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """NanoChatForCausalLM."""
    norm = NormConfig("rms", hf.rms_norm_eps, has_weight=False)
    layers = tuple(
        dataclasses.replace(layer, rope=dataclasses.replace(layer.rope, inverted=True)) for layer in layers_of(hf)
    )
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers,
        norm=norm,
        mlp=MLPConfig(hf.hidden_act, gated=False),
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=QKNormConfig(norm, after_rope=True),
        embedding_norm=True,
        final_logit_softcap=hf.final_logit_softcapping,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class NanoChatForCausalLM(DecoderForCausalLM):
    """NanoChat (HF architecture NanoChatForCausalLM)."""

    arch_config_of = staticmethod(nanochat_arch_config)
    checkpoint_names = NANOCHAT_NAMES
