"""Falcon-H1: every layer runs attention and Mamba 2 side by side on the same normed input (a parallel
mixer), with muP multipliers on nearly every path: the embeddings, attention input and output, keys,
the Mamba input, each part of its in_proj output (`ssm_multipliers`) and its output, the MLP's gate
and down projection, and the logits. Bamba's checkpoint names."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.recurrent import Mamba2MixerConfig
from llmplug.plugins.models.arch_config import refuse
from llmplug.plugins.models.bamba import BAMBA_NAMES, mamba2_fields
from llmplug.plugins.models.llama import llama_fields

__all__ = ["FalconH1ForCausalLM"]


def _mixer(hf: PretrainedConfig) -> Mamba2MixerConfig:
    intermediate = hf.mamba_d_ssm if hf.mamba_d_ssm is not None else int(hf.mamba_expand * hf.hidden_size)
    refuse(hf, intermediate != hf.mamba_n_heads * hf.mamba_d_head, "mamba_d_ssm different from heads x head dim")
    refuse(hf, hf.mamba_proj_bias != hf.projectors_bias, "different biases on the Mamba in and out projections")
    return Mamba2MixerConfig(
        **mamba2_fields(hf),
        proj_bias=bool(hf.projectors_bias),
        gated_norm=bool(hf.mamba_rms_norm),
        norm_before_gate=bool(hf.mamba_norm_before_gate),
        in_multiplier=hf.ssm_in_multiplier,
        projection_multipliers=tuple(hf.ssm_multipliers),
    )


def falcon_h1_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """FalconH1ForCausalLM."""
    fields = llama_fields(hf)
    gate, down = hf.mlp_multipliers
    fields["layers"] = tuple(replace(layer, parallel_mixer="mamba2") for layer in fields["layers"])
    fields["mlp"] = MLPConfig(hf.hidden_act, bias=bool(hf.mlp_bias), gate_multiplier=gate, down_multiplier=down)
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **fields,
        qkv_bias=bias,
        o_proj_bias=bias,
        mamba2=_mixer(hf),
        key_multiplier=hf.key_multiplier,
        attention_in_multiplier=hf.attention_in_multiplier,
        attention_out_multiplier=hf.attention_out_multiplier,
        parallel_mixer_out_multiplier=hf.ssm_out_multiplier,
        embedding_multiplier=hf.embedding_multiplier,
        embedding_multiplier_in_table=True,  # transformers scales looked-up tokens only
        logits_multiplier=hf.lm_head_multiplier,
    )


class FalconH1ForCausalLM(DecoderForCausalLM):
    """Falcon-H1 (HF architecture FalconH1ForCausalLM)."""

    arch_config_of = staticmethod(falcon_h1_arch_config)
    checkpoint_names = BAMBA_NAMES
