"""LFM2 and LFM2-MoE: Llama-like layers whose token mixer is a gated short convolution, or attention with
per-head q/k RMSNorm (`layer_types`: "conv" / "full_attention"); the final norm is named `embedding_norm`.

LFM2-MoE keeps dense MLPs on its first `num_dense_layers` layers and a mixture of experts after them:
sigmoid scores, top-k chosen with a correction bias (`expert_bias`), renormalised, scaled.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.layers.recurrent import ShortConvConfig
from llmplug.plugins.models.arch_config import moe_layers, rope_config_of, sizes_of

__all__ = ["Lfm2ForCausalLM", "Lfm2MoeForCausalLM"]

LFM2_NAMES = CheckpointNames(
    prefixes={"model.embedding_norm": "model.norm"},
    renames={
        "operator_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "feed_forward": "mlp",
        "w1": "gate_proj",
        "w3": "up_proj",
        "w2": "down_proj",
        "self_attn.out_proj": "self_attn.o_proj",
        "q_layernorm": "q_norm",
        "k_layernorm": "k_norm",
        "conv.in_proj": "mixer.in_proj",
        "conv.conv": "mixer.conv",
        "conv.out_proj": "mixer.out_proj",
        "expert_bias": "gate.e_score_correction_bias",
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


def lfm2_fields(hf: PretrainedConfig, ffn_size: int) -> dict:
    """The DecoderArchConfig fields of LFM2 and LFM2-MoE, with a dense MLP of `ffn_size`."""
    attention = LayerConfig(rope_config_of(hf))
    layers = tuple(
        attention if kind == "full_attention" else LayerConfig(None, mixer="short_conv") for kind in hf.layer_types
    )
    norm = NormConfig("rms", hf.norm_eps)
    return dict(
        **sizes_of(hf, intermediate_size=ffn_size),
        layers=layers,
        norm=norm,
        mlp=MLPConfig("silu"),
        qk_norm=QKNormConfig(norm),
        short_conv=ShortConvConfig(hf.conv_L_cache, bool(hf.conv_bias)),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


def lfm2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Lfm2ForCausalLM."""
    return DecoderArchConfig(**lfm2_fields(hf, _ffn_size(hf)))


def lfm2_moe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Lfm2MoeForCausalLM: dense MLPs of `intermediate_size` first, then experts of `moe_intermediate_size`."""
    fields = lfm2_fields(hf, hf.intermediate_size)
    router = RouterConfig(
        hf.num_experts,
        hf.num_experts_per_tok,
        scoring="sigmoid",
        topk_norm=1.0 if hf.norm_topk_prob else None,
        correction_bias=bool(hf.use_expert_bias),
        scaling_factor=hf.routed_scaling_factor,
    )
    layers = moe_layers(fields["layers"], lambda i: i >= hf.num_dense_layers)
    return DecoderArchConfig(**fields | {"layers": layers}, moe=MoEConfig(router, hf.moe_intermediate_size, "silu"))


class Lfm2ForCausalLM(DecoderForCausalLM):
    """LFM2 (HF architecture Lfm2ForCausalLM)."""

    arch_config_of = staticmethod(lfm2_arch_config)
    checkpoint_names = LFM2_NAMES


class Lfm2MoeForCausalLM(DecoderForCausalLM):
    """LFM2-MoE (HF architecture Lfm2MoeForCausalLM)."""

    arch_config_of = staticmethod(lfm2_moe_arch_config)
    checkpoint_names = LFM2_NAMES
