"""DBRX: bias-free LayerNorms, a fused Wqkv clamped to `clip_qkv`, and a mixture of experts on every layer.

Router: softmax, top-k, weights divided by their `moe_normalize_expert_weights`-norm. The checkpoint
stores each projection of all experts as one flat tensor: `ffn.experts.mlp.w1` / `v1` [E * I, hidden]
(gate, up) and `w2` [E * I, hidden] (down, transposed).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import EXPERTS_FLAT, EXPERTS_FLAT_T, QKV_CONTIGUOUS, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.plugins.models.arch_config import layers_of, moe_layers, sizes_of

__all__ = ["DbrxForCausalLM"]

DBRX_LAYER_NORM_EPS = 1e-5  # transformers' nn.LayerNorm default, not in the config

DBRX_NAMES = CheckpointNames(
    prefixes={
        "transformer.wte": "model.embed_tokens",
        "transformer.norm_f": "model.norm",
        "transformer.blocks": "model.layers",
    },
    renames={
        "norm_attn_norm.norm_1": "input_layernorm",
        "norm_attn_norm.norm_2": "post_attention_layernorm",
        "norm_attn_norm.attn.Wqkv": "self_attn.qkv",
        "norm_attn_norm.attn.out_proj": "self_attn.o_proj",
        "ffn.router.layer": "mlp.gate",
        "ffn.experts.mlp.w1": "mlp.experts.gate_proj.weight",
        "ffn.experts.mlp.v1": "mlp.experts.up_proj.weight",
        "ffn.experts.mlp.w2": "mlp.experts.down_proj.weight",
    },
    fused={
        "self_attn.qkv": QKV_CONTIGUOUS,
        "experts.gate_proj": EXPERTS_FLAT,
        "experts.up_proj": EXPERTS_FLAT,
        "experts.down_proj": EXPERTS_FLAT_T,
    },
)


def dbrx_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """DbrxForCausalLM."""
    ffn = hf.ffn_config
    router = RouterConfig(ffn.moe_num_experts, ffn.moe_top_k, topk_norm=ffn.moe_normalize_expert_weights)
    activation = ffn.ffn_act_fn.get("name", "silu")
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=ffn.ffn_hidden_size) | {"num_kv_heads": hf.attn_config.kv_n_heads},
        layers=moe_layers(layers_of(hf)),
        norm=NormConfig("layer", DBRX_LAYER_NORM_EPS),
        moe=MoEConfig(router, ffn.ffn_hidden_size, activation),
        clip_qkv=hf.attn_config.clip_qkv,
    )


class DbrxForCausalLM(DecoderForCausalLM):
    """DBRX (HF architecture DbrxForCausalLM)."""

    arch_config_of = staticmethod(dbrx_arch_config)
    checkpoint_names = DBRX_NAMES
