"""Persimmon (Fuyu's language model): LayerNorm, per-head LayerNorm on q and k, partial rotary,
squared-ReLU MLP, q/k/v fused per head in the checkpoint."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import QKV_PER_HEAD, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["PersimmonForCausalLM"]

PERSIMMON_NAMES = CheckpointNames(
    prefixes={"model.final_layernorm": "model.norm"},
    renames={
        "self_attn.query_key_value": "self_attn.qkv_proj",
        "self_attn.dense": "self_attn.o_proj",
        "self_attn.q_layernorm": "self_attn.q_norm",
        "self_attn.k_layernorm": "self_attn.k_norm",
        "mlp.dense_h_to_4h": "mlp.up_proj",
        "mlp.dense_4h_to_h": "mlp.down_proj",
    },
    fused={"self_attn.qkv_proj": QKV_PER_HEAD},
)


def persimmon_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """PersimmonForCausalLM."""
    norm = NormConfig("layer", hf.layer_norm_eps, bias=True)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=norm,
        mlp=MLPConfig(hf.hidden_act, gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        qk_norm=QKNormConfig(norm) if hf.qk_layernorm else None,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class PersimmonForCausalLM(DecoderForCausalLM):
    """Persimmon (HF architecture PersimmonForCausalLM)."""

    arch_config_of = staticmethod(persimmon_arch_config)
    checkpoint_names = PERSIMMON_NAMES
