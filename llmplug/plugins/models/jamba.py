"""Jamba: Llama-like layers whose token mixer is Mamba (with RMS-normed dt, B, C) or attention without
rotary, every `attn_layer_period`-th layer from `attn_layer_offset`; Bamba's checkpoint names."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.recurrent import MambaMixerConfig
from llmplug.plugins.models.arch_config import refuse
from llmplug.plugins.models.bamba import BAMBA_NAMES
from llmplug.plugins.models.llama import llama_fields

__all__ = ["JambaForCausalLM"]


def jamba_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """JambaForCausalLM with dense MLPs (`num_experts == 1`)."""
    refuse(hf, hf.num_experts > 1, "expert layers (num_experts > 1) before the fused MoE layer lands")
    layers = tuple(LayerConfig(None, mixer="attention" if kind == "attention" else "mamba") for kind in hf.layers_block_type)
    mixer = MambaMixerConfig(
        intermediate_size=hf.mamba_expand * hf.hidden_size,
        state_size=hf.mamba_d_state,
        conv_kernel=hf.mamba_d_conv,
        time_step_rank=hf.mamba_dt_rank,
        conv_bias=bool(hf.mamba_conv_bias),
        proj_bias=bool(hf.mamba_proj_bias),
        activation=hf.hidden_act,
        dt_bc_norm="weighted",
        dt_bc_norm_eps=hf.rms_norm_eps,
    )
    return DecoderArchConfig(**(llama_fields(hf) | {"layers": layers}), mamba=mixer)


class JambaForCausalLM(DecoderForCausalLM):
    """Jamba (HF architecture JambaForCausalLM)."""

    arch_config_of = staticmethod(jamba_arch_config)
    checkpoint_names = BAMBA_NAMES
