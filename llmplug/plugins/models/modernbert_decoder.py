"""ModernBERT decoder (Ettin decoders): LayerNorm (optionally bias-free) after the embeddings, none before the
first layer's attention, local (windowed) layers with their own rope base interleaved with global ones, a
fused GeGLU MLP (`Wi` = [activated | gate]), and ModernBERT's prediction head (dense, activation, LayerNorm)
before the tied decoder."""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import GATE_UP, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, HeadTransformConfig, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import SLIDING, layers_of, refuse, sizes_of

__all__ = ["ModernBertDecoderForCausalLM"]

MODERNBERT_DECODER_NAMES = CheckpointNames(
    prefixes={
        "model.embeddings.tok_embeddings": "model.embed_tokens",
        "model.embeddings.norm": "model.embed_norm",
        "model.final_norm": "model.norm",
        "lm_head": "model.head_transform",
        "decoder": "lm_head",
    },
    renames={
        "attn": "self_attn",
        "Wo": "o_proj",  # the attention's (the MLP's is renamed below, whole path first)
        "mlp.Wi": "mlp.gate_up_proj",
        "mlp.Wo": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "mlp_norm": "post_attention_layernorm",
    },
    fused={"mlp.gate_up_proj": GATE_UP},
)


def modernbert_decoder_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """ModernBertDecoderForCausalLM."""
    refuse(hf, SLIDING in hf.layer_types and hf.sliding_window <= 0, "sliding layers without local_attention")
    bias = bool(hf.attention_bias)
    first, *rest = layers_of(hf)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=(dataclasses.replace(first, input_norm=False), *rest),
        norm=NormConfig("layer", hf.norm_eps, bias=bool(hf.norm_bias)),
        mlp=MLPConfig(hf.hidden_activation, bias=bool(hf.mlp_bias)),
        qkv_bias=bias,
        o_proj_bias=bias,
        embedding_norm=True,
        head_transform=HeadTransformConfig(hf.classifier_activation, bool(hf.classifier_bias)),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        lm_head_bias=bool(hf.decoder_bias),
    )


class ModernBertDecoderForCausalLM(DecoderForCausalLM):
    """ModernBERT decoder / Ettin decoders (HF architecture ModernBertDecoderForCausalLM)."""

    arch_config_of = staticmethod(modernbert_decoder_arch_config)
    checkpoint_names = MODERNBERT_DECODER_NAMES
