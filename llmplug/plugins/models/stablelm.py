"""StableLM (StableLM-3B-4E1T, StableLM 2, Stable Code): LayerNorm with bias, partial rotary, gated SiLU,
optional q/k/v biases and a parallel residual with one norm. StableLM 2 12B (`qk_layernorm`) normalizes each
q and k head with its own bias-free LayerNorm, stored as one tensor per head (`q_layernorm.norms.{h}`)."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["StableLmForCausalLM"]

STABLELM_NAMES = CheckpointNames(
    stacked={"self_attn.q_layernorm.norms": "self_attn.q_norm", "self_attn.k_layernorm.norms": "self_attn.k_norm"}
)


def stablelm_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """StableLmForCausalLM."""
    qk_norm = QKNormConfig(NormConfig("layer", hf.layer_norm_eps), scope="per_head") if hf.qk_layernorm else None
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=NormConfig("layer", hf.layer_norm_eps, bias=True),
        mlp=MLPConfig(hf.hidden_act),
        qkv_bias=bool(hf.use_qkv_bias),
        qk_norm=qk_norm,
        parallel_residual=bool(hf.use_parallel_residual),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class StableLmForCausalLM(DecoderForCausalLM):
    """StableLM (HF architecture StableLmForCausalLM)."""

    arch_config_of = staticmethod(stablelm_arch_config)
    checkpoint_names = STABLELM_NAMES
