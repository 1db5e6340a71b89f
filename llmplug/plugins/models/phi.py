"""Phi (phi-1, phi-1.5, phi-2) and Phi-3 / Phi-4-mini.

Phi: one LayerNorm feeding attention and MLP in parallel, partial rotary, GELU MLP (fc1, fc2), an
LM head with a bias, optional per-head LayerNorm on q and k. Phi-3: the Llama decoder with q/k/v
and gate/up stored fused in the checkpoint (`qkv_proj`, `gate_up_proj`).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import GATE_UP, QKV_CONTIGUOUS, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Phi3ForCausalLM", "PhiForCausalLM"]

PHI_NAMES = CheckpointNames(
    prefixes={"model.final_layernorm": "model.norm"},
    renames={
        "self_attn.dense": "self_attn.o_proj",
        "self_attn.q_layernorm": "self_attn.q_norm",
        "self_attn.k_layernorm": "self_attn.k_norm",
        "mlp.fc1": "mlp.up_proj",
        "mlp.fc2": "mlp.down_proj",
    },
)
PHI3_NAMES = CheckpointNames(fused={"self_attn.qkv_proj": QKV_CONTIGUOUS, "mlp.gate_up_proj": GATE_UP})


def phi_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """PhiForCausalLM."""
    norm = NormConfig("layer", hf.layer_norm_eps, bias=True)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=norm,
        mlp=MLPConfig(hf.hidden_act, gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        qk_norm=QKNormConfig(norm) if hf.qk_layernorm else None,
        parallel_residual=True,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        lm_head_bias=True,
    )


def phi3_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Phi3ForCausalLM: Llama flags, fused checkpoint tensors (see PHI3_NAMES)."""
    return DecoderArchConfig(**llama_fields(hf))


class PhiForCausalLM(DecoderForCausalLM):
    """Phi 1, 1.5, 2 (HF architecture PhiForCausalLM)."""

    arch_config_of = staticmethod(phi_arch_config)
    checkpoint_names = PHI_NAMES


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3, Phi-3.5, Phi-4-mini (HF architecture Phi3ForCausalLM)."""

    arch_config_of = staticmethod(phi3_arch_config)
    checkpoint_names = PHI3_NAMES
