"""The Gemma family: Gemma, Gemma 2, Gemma 3 (text), VaultGemma — RMSNorm with `1 + w`, GeGLU, embeddings
scaled by sqrt(hidden).

Gemma 2 adds sandwich norms (before and after each sublayer), attention and final logit soft-capping,
`query_pre_attn_scalar` and alternating sliding-window layers; Gemma 3 drops the soft-caps, adds q/k
norms and a rope per layer type (local and global bases); VaultGemma is Gemma 2 with the norms before each
sublayer only. Checkpoint names are transformers' Llama names (VaultGemma's MLP norm: `VAULTGEMMA_NAMES`).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of, refuse, sizes_of

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "GemmaForCausalLM", "VaultGemmaForCausalLM"]

# VaultGemma keeps Gemma 2's name for the norm before the MLP
VAULTGEMMA_NAMES = CheckpointNames(renames={"pre_feedforward_layernorm": "post_attention_layernorm"})


def _gemma_norm(hf: PretrainedConfig) -> NormConfig:
    return NormConfig("rms", hf.rms_norm_eps, weight_offset=1.0)


def gemma_fields(hf: PretrainedConfig) -> dict[str, Any]:
    """What every Gemma generation shares."""
    refuse(hf, bool(getattr(hf, "use_bidirectional_attention", False)), "use_bidirectional_attention")
    bias = bool(getattr(hf, "attention_bias", False))
    return dict(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=_gemma_norm(hf),
        mlp=MLPConfig(getattr(hf, "hidden_activation", None) or hf.hidden_act),
        qkv_bias=bias,
        o_proj_bias=bias,
        embedding_multiplier=hf.hidden_size**0.5,
        embedding_multiplier_in_table=True,  # transformers' embedding module scales
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


def gemma_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GemmaForCausalLM."""
    return DecoderArchConfig(**gemma_fields(hf))


def gemma2_fields(hf: PretrainedConfig) -> dict[str, Any]:
    """Gemma 2 and 3: sandwich norms, soft-caps (None in Gemma 3), query_pre_attn_scalar, windows from layer_types."""
    return gemma_fields(hf) | dict(
        post_norm=True,
        attention_scale=hf.query_pre_attn_scalar**-0.5,
        attn_logit_softcap=hf.attn_logit_softcapping,
        final_logit_softcap=hf.final_logit_softcapping,
    )


def gemma2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Gemma2ForCausalLM."""
    return DecoderArchConfig(**gemma2_fields(hf))


def gemma3_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Gemma3ForCausalLM (text only): Gemma 2 plus q/k norms; local and global layers have their own rope."""
    return DecoderArchConfig(**gemma2_fields(hf), qk_norm=QKNormConfig(_gemma_norm(hf)))


def vaultgemma_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """VaultGemmaForCausalLM: Gemma 2 without the norms after each sublayer."""
    return DecoderArchConfig(**gemma2_fields(hf) | {"post_norm": False})


class GemmaForCausalLM(DecoderForCausalLM):
    """Gemma 1 (HF architecture GemmaForCausalLM)."""

    arch_config_of = staticmethod(gemma_arch_config)


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2 (HF architecture Gemma2ForCausalLM)."""

    arch_config_of = staticmethod(gemma2_arch_config)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 text models (HF architecture Gemma3ForCausalLM, model_type gemma3_text)."""

    arch_config_of = staticmethod(gemma3_arch_config)


class VaultGemmaForCausalLM(DecoderForCausalLM):
    """VaultGemma (HF architecture VaultGemmaForCausalLM)."""

    arch_config_of = staticmethod(vaultgemma_arch_config)
    checkpoint_names = VAULTGEMMA_NAMES
