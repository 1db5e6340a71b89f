"""Qwen3-Next and Qwen3.5 (dense and MoE): layers whose token mixer is a gated delta net (`linear_attn`)
or gated attention (q_proj gives each head a sigmoid output gate; q/k RMSNorm 1 + w, partial rotary),
with Gemma-style RMSNorm 1 + w everywhere else. Their mixtures of experts are Qwen2-MoE's: softmax
top-k (renormalised), a shared expert gated by sigmoid(x w).

Qwen3-Next stores the delta net's projections interleaved per key head (`in_proj_qkvz`, `in_proj_ba`),
Qwen3.5 as four plain ones. Qwen3.5's multimodal rotary (MRoPE) reduces to plain rotary on text, where
the three position components are equal.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.layers.recurrent.gated_delta_net import GatedDeltaNetConfig, ProjectionLayout
from llmplug.plugins.models.arch_config import layers_of, moe_layers, sizes_of
from llmplug.plugins.models.bamba import hybrid_layers

__all__ = ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "qwen3_next_fields"]

QWEN3_NEXT_NAMES = CheckpointNames(renames={"linear_attn": "mixer", "shared_expert": "shared_experts"})


def gated_delta_net_config_of(hf: PretrainedConfig, layout: ProjectionLayout) -> GatedDeltaNetConfig:
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


def qwen3_next_fields(hf: PretrainedConfig, layout: ProjectionLayout, intermediate_size: int) -> dict:
    """The DecoderArchConfig fields shared by Qwen3-Next and Qwen3.5 (dense MLPs of `intermediate_size`)."""
    norm = NormConfig("rms", hf.rms_norm_eps, weight_offset=1.0)
    bias = bool(hf.attention_bias)
    return dict(
        **sizes_of(hf, intermediate_size),
        layers=hybrid_layers(layers_of(hf), hf.layer_types, "gated_delta_net"),
        norm=norm,
        mlp=MLPConfig(hf.hidden_act),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=QKNormConfig(norm),
        attention_output_gate=True,
        gated_delta_net=gated_delta_net_config_of(hf, layout),
    )


def _moe(hf: PretrainedConfig, topk_norm: bool) -> MoEConfig:
    router = RouterConfig(hf.num_experts, hf.num_experts_per_tok, topk_norm=1.0 if topk_norm else None)
    return MoEConfig(
        router,
        hf.moe_intermediate_size,
        hf.hidden_act,
        shared_intermediate_size=hf.shared_expert_intermediate_size,
        shared_expert_gate=True,
    )


def qwen3_next_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen3NextForCausalLM: experts on the layers `decoder_sparse_step` picks, unless in `mlp_only_layers`."""
    fields = qwen3_next_fields(hf, "grouped", hf.intermediate_size)
    dense, step = set(hf.mlp_only_layers), hf.decoder_sparse_step
    is_moe = lambda i: i not in dense and hf.num_experts > 0 and (i + 1) % step == 0  # noqa: E731
    fields["layers"] = moe_layers(fields["layers"], is_moe)
    return DecoderArchConfig(**fields, moe=_moe(hf, hf.norm_topk_prob) if hf.num_experts else None)


def qwen3_5_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen3_5ForCausalLM (the text model of Qwen3.5, dense MLPs)."""
    return DecoderArchConfig(**qwen3_next_fields(hf, "split", hf.intermediate_size))


def qwen3_5_moe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen3_5MoeForCausalLM: experts on every layer (no dense MLP)."""
    fields = qwen3_next_fields(hf, "split", hf.moe_intermediate_size)  # the dense width is unused
    return DecoderArchConfig(**fields | {"layers": moe_layers(fields["layers"])}, moe=_moe(hf, True))


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """Qwen3-Next (HF architecture Qwen3NextForCausalLM)."""

    arch_config_of = staticmethod(qwen3_next_arch_config)
    checkpoint_names = QWEN3_NEXT_NAMES


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 text (HF architecture Qwen3_5ForCausalLM)."""

    arch_config_of = staticmethod(qwen3_5_arch_config)
    checkpoint_names = QWEN3_NEXT_NAMES


class Qwen3_5MoeForCausalLM(DecoderForCausalLM):
    """Qwen3.5 MoE text (HF architecture Qwen3_5MoeForCausalLM)."""

    arch_config_of = staticmethod(qwen3_5_moe_arch_config)
    checkpoint_names = QWEN3_NEXT_NAMES
