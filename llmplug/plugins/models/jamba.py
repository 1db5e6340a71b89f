"""Jamba: Llama-like layers whose token mixer is Mamba (with RMS-normed dt, B, C) or attention without
rotary, every `attn_layer_period`-th layer from `attn_layer_offset`; a mixture of experts every
`expert_layer_period`-th layer from `expert_layer_offset` (softmax top-k, not renormalised). Bamba's
checkpoint names, the experts' router called `router`."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.layers.recurrent import MambaMixerConfig
from llmplug.plugins.models.bamba import BAMBA_NAMES
from llmplug.plugins.models.llama import llama_fields

__all__ = ["JambaForCausalLM"]

JAMBA_NAMES = replace(BAMBA_NAMES, renames={**BAMBA_NAMES.renames, "feed_forward.router": "mlp.gate"})


def jamba_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """JambaForCausalLM (`num_experts == 1`: dense MLPs only)."""
    layers = tuple(
        LayerConfig(None, mixer="attention" if kind == "attention" else "mamba", moe=experts > 1)
        for kind, experts in zip(hf.layers_block_type, hf.layers_num_experts)
    )
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
    moe = None
    if hf.num_experts > 1:
        moe = MoEConfig(RouterConfig(hf.num_experts, hf.num_experts_per_tok), hf.intermediate_size, hf.hidden_act)
    return DecoderArchConfig(**(llama_fields(hf) | {"layers": layers}), mamba=mixer, moe=moe)


class JambaForCausalLM(DecoderForCausalLM):
    """Jamba (HF architecture JambaForCausalLM)."""

    arch_config_of = staticmethod(jamba_arch_config)
    checkpoint_names = JAMBA_NAMES
