"""Bamba and Granite 4 hybrids (GraniteMoeHybrid): Llama-like layers whose token mixer is Mamba 2 or
attention (`layers_block_type`), the Mamba 2 settings in `mamba_*` fields.

Bamba's checkpoints call the mixer `mamba`, the MLP `feed_forward` (its norm `pre_ff_layernorm`) and
the final norm `final_layernorm`.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.recurrent import Mamba2MixerConfig
from llmplug.plugins.models.arch_config import refuse
from llmplug.plugins.models.llama import llama_fields

__all__ = ["BambaForCausalLM", "hybrid_layers", "mamba2_config_of", "mamba2_fields"]

ATTENTION = "full_attention"
BAMBA_NAMES = CheckpointNames(
    prefixes={"model.final_layernorm": "model.norm"},
    renames={"mamba": "mixer", "feed_forward": "mlp", "pre_ff_layernorm": "post_attention_layernorm"},
)


def mamba2_fields(hf: PretrainedConfig) -> dict[str, Any]:
    """The Mamba2MixerConfig fields every config with `mamba_*` fields carries (Bamba, GraniteMoeHybrid, Falcon-H1)."""
    return dict(
        num_heads=hf.mamba_n_heads,
        head_dim=hf.mamba_d_head,
        state_size=hf.mamba_d_state,
        n_groups=hf.mamba_n_groups,
        conv_kernel=hf.mamba_d_conv,
        chunk_size=hf.mamba_chunk_size,
        conv_bias=bool(hf.mamba_conv_bias),
        time_step_limit=tuple(hf.time_step_limit),
        norm_eps=hf.rms_norm_eps,
    )


def mamba2_config_of(hf: PretrainedConfig) -> Mamba2MixerConfig:
    """The Mamba 2 mixer of a config with `mamba_*` fields (Bamba, GraniteMoeHybrid)."""
    refuse(hf, int(hf.mamba_expand * hf.hidden_size) != hf.mamba_n_heads * hf.mamba_d_head,
           "mamba_expand * hidden_size different from mamba_n_heads * mamba_d_head")
    return Mamba2MixerConfig(**mamba2_fields(hf), proj_bias=bool(hf.mamba_proj_bias))


def hybrid_layers(attention_layers: tuple[LayerConfig, ...], kinds: list[str], mixer: str) -> tuple[LayerConfig, ...]:
    """Layer i: `attention_layers[i]` where kinds[i] is attention, else a `mixer` layer (no rope, no window)."""
    return tuple(
        attention if kind == ATTENTION else LayerConfig(None, mixer=mixer)
        for attention, kind in zip(attention_layers, kinds)
    )


def bamba_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """BambaForCausalLM: Mamba 2 layers and attention layers (partial rotary), Llama's norms and MLP."""
    fields = llama_fields(hf)
    fields["layers"] = hybrid_layers(fields["layers"], hf.layers_block_type, "mamba2")
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(**fields, qkv_bias=bias, o_proj_bias=bias, mamba2=mamba2_config_of(hf))


class BambaForCausalLM(DecoderForCausalLM):
    """Bamba (HF architecture BambaForCausalLM)."""

    arch_config_of = staticmethod(bamba_arch_config)
    checkpoint_names = BAMBA_NAMES
