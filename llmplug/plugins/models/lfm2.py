"""LFM2: Llama-like layers whose token mixer is a gated short convolution, or attention with per-head
q/k RMSNorm (`layer_types`: "conv" / "full_attention"); the final norm is named `embedding_norm`."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.layers.recurrent import ShortConvConfig
from llmplug.plugins.models.arch_config import rope_config_of, sizes_of

__all__ = ["Lfm2ForCausalLM", "lfm2_fields"]

LFM2_NAMES = CheckpointNames(
    prefixes={"model.embedding_norm": "model.norm"},
    renames={
        "operator_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
        "self_attn.out_proj": "self_attn.o_proj",
        "q_layernorm": "q_norm",
        "k_layernorm": "k_norm",
        "conv.in_proj": "mixer.in_proj",
        "conv.conv": "mixer.conv",
        "conv.out_proj": "mixer.out_proj",
    },
)


def _ffn_size(hf: PretrainedConfig) -> int:
    """The MLP width: with `block_auto_adjust_ff_dim`, 2/3 of intermediate_size, scaled, rounded up to a multiple."""
    size = hf.intermediate_size
    if hf.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if hf.block_ffn_dim_multiplier is not None:
            size = int(hf.block_ffn_dim_multiplier * size)
            size = hf.block_multiple_of * -(-size // hf.block_multiple_of)
    return size


def lfm2_fields(hf: PretrainedConfig) -> dict:
    """The DecoderArchConfig fields of LFM2 (also LFM2-MoE's, but for its MLP)."""
    attention = LayerConfig(rope_config_of(hf))
    layers = tuple(
        attention if kind == "full_attention" else LayerConfig(None, mixer="short_conv") for kind in hf.layer_types
    )
    norm = NormConfig("rms", hf.norm_eps)
    return dict(
        **sizes_of(hf, intermediate_size=_ffn_size(hf)),
        layers=layers,
        norm=norm,
        mlp=MLPConfig("silu"),
        qk_norm=QKNormConfig(norm),
        short_conv=ShortConvConfig(hf.conv_L_cache, bool(hf.conv_bias)),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


def lfm2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Lfm2ForCausalLM."""
    return DecoderArchConfig(**lfm2_fields(hf))


class Lfm2ForCausalLM(DecoderForCausalLM):
    """LFM2 (HF architecture Lfm2ForCausalLM)."""

    arch_config_of = staticmethod(lfm2_arch_config)
    checkpoint_names = LFM2_NAMES
