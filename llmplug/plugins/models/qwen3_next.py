"""Qwen3-Next and Qwen3.5: layers whose token mixer is a gated delta net (`linear_attn`) or gated
attention (q_proj gives each head a sigmoid output gate; q/k RMSNorm 1 + w, partial rotary), with
Gemma-style RMSNorm 1 + w everywhere else.

Qwen3-Next stores the delta net's projections interleaved per key head (`in_proj_qkvz`, `in_proj_ba`),
Qwen3.5 as four plain ones. Qwen3.5's multimodal rotary (MRoPE) reduces to plain rotary on text, where
the three position components are equal.
"""

from __future__ import annotations

from typing import Literal

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.layers.recurrent import GatedDeltaNetConfig
from llmplug.plugins.models.arch_config import refuse
from llmplug.plugins.models.bamba import hybrid_layers
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "qwen3_next_fields"]

QWEN3_NEXT_NAMES = CheckpointNames(renames={"linear_attn": "mixer"})


def gated_delta_net_config_of(hf: PretrainedConfig, layout: Literal["grouped", "split"]) -> GatedDeltaNetConfig:
    """The delta net of a config with `linear_*` fields."""
    return GatedDeltaNetConfig(
        num_key_heads=hf.linear_num_key_heads,
        num_value_heads=hf.linear_num_value_heads,
        key_head_dim=hf.linear_key_head_dim,
        value_head_dim=hf.linear_value_head_dim,
        conv_kernel=hf.linear_conv_kernel_dim,
        norm_eps=hf.rms_norm_eps,
        activation=hf.hidden_act,
        projection_layout=layout,
    )


def qwen3_next_fields(hf: PretrainedConfig, layout: Literal["grouped", "split"]) -> dict:
    """The DecoderArchConfig fields shared by Qwen3-Next and Qwen3.5 (but for the MLP kind of each layer)."""
    norm = NormConfig("rms", hf.rms_norm_eps, weight_offset=1.0)
    fields = llama_fields(hf, norm)
    fields["layers"] = hybrid_layers(fields["layers"], hf.layer_types, "gated_delta_net")
    bias = bool(hf.attention_bias)
    return fields | dict(
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=QKNormConfig(norm),
        attention_output_gate=True,
        gated_delta_net=gated_delta_net_config_of(hf, layout),
    )


def qwen3_next_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen3NextForCausalLM whose layers all use the dense MLP (`mlp_only_layers`, or `num_experts == 0`)."""
    sparse = [
        i for i in range(hf.num_hidden_layers)
        if i not in hf.mlp_only_layers and hf.num_experts > 0 and (i + 1) % hf.decoder_sparse_step == 0
    ]
    refuse(hf, bool(sparse), f"expert layers {sparse} before the fused MoE layer lands")
    return DecoderArchConfig(**qwen3_next_fields(hf, "grouped"))


def qwen3_5_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen3_5ForCausalLM (the text model of Qwen3.5, dense MLPs)."""
    return DecoderArchConfig(**qwen3_next_fields(hf, "split"))


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """Qwen3-Next (HF architecture Qwen3NextForCausalLM)."""

    arch_config_of = staticmethod(qwen3_next_arch_config)
    checkpoint_names = QWEN3_NEXT_NAMES


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 text (HF architecture Qwen3_5ForCausalLM)."""

    arch_config_of = staticmethod(qwen3_5_arch_config)
    checkpoint_names = QWEN3_NEXT_NAMES
