"""Lara Mini: Qwen3.5's layer mix with plain parts — gated delta nets (one fused `in_proj`, rows
[q | k | v | z | b | a]; the gated norm named `out_norm`), Qwen3 attention (per-head q/k RMSNorm, no
output gate) on windowed layers with rotary and on full layers without it (NoPE), RMSNorm with a plain
weight, and on every layer stacked experts with an ungated shared expert (softmax top-k, renormalised)."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import EXPERTS, STACKED_EXPERT_LEAVES, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of
from llmplug.plugins.models.qwen3_next import gated_delta_net_config_of

__all__ = ["LaraMiniForCausalLM"]

LINEAR, FULL = "linear_attention", "full_attention"
# experts saved stacked, as transformers holds them: [E, 2 * I, hidden] ([gate | up]) and [E, hidden, I]
LARA_MINI_NAMES = CheckpointNames(
    renames={"linear_attn": "mixer", "out_norm": "norm", "shared_expert": "shared_experts", **STACKED_EXPERT_LEAVES},
    fused={"experts.gate_up_proj": EXPERTS, "experts.down_proj": EXPERTS},
)


def lara_mini_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """LaraMiniForCausalLM."""
    kinds = hf.layer_types
    attention = layers_of(hf, nope_layers=[i for i, kind in enumerate(kinds) if kind == FULL])
    layers = tuple(
        replace(LayerConfig(None, mixer="gated_delta_net") if kind == LINEAR else layer, moe=True)
        for layer, kind in zip(attention, kinds)
    )
    norm = NormConfig("rms", hf.rms_norm_eps)
    router = RouterConfig(hf.num_experts, hf.num_experts_per_tok, topk_norm=1.0 if hf.norm_topk_prob else None)
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **sizes_of(hf, hf.moe_intermediate_size),  # no dense MLP: the dense width is unused
        layers=layers,
        norm=norm,
        mlp=MLPConfig(hf.hidden_act),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=QKNormConfig(norm),
        gated_delta_net=gated_delta_net_config_of(hf, "fused"),
        moe=MoEConfig(
            router, hf.moe_intermediate_size, hf.hidden_act, shared_intermediate_size=hf.shared_expert_intermediate_size
        ),
    )


class LaraMiniForCausalLM(DecoderForCausalLM):
    """Lara Mini (HF architecture LaraMiniForCausalLM)."""

    arch_config_of = staticmethod(lara_mini_arch_config)
    checkpoint_names = LARA_MINI_NAMES
