"""Hunyuan-A13B (HunYuanMoEV1): the Llama decoder with per-head q/k RMSNorm *after* the rotary, and on
every layer a mixture of experts beside an always-on shared MLP, both of `intermediate_size`.

Router (`mlp.gate.wg`, float32): softmax, top-k, renormalised. Checkpoint names are transformers'
(`query_layernorm` / `key_layernorm`, `shared_mlp`, experts one by one).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import moe_layers, refuse
from llmplug.plugins.models.llama import llama_fields

__all__ = ["HunYuanMoEV1ForCausalLM"]


def hunyuan_moe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """HunYuanMoEV1ForCausalLM."""
    refuse(hf, isinstance(hf.num_experts, list) or isinstance(hf.moe_topk, list), "a per-layer expert count or top-k")
    router = RouterConfig(hf.num_experts, hf.moe_topk, topk_norm=1.0, float32=True)
    size = hf.intermediate_size
    fields = llama_fields(hf)
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **fields | {"layers": moe_layers(fields["layers"])},
        moe=MoEConfig(router, size, hf.hidden_act, shared_intermediate_size=size),
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=QKNormConfig(NormConfig("rms", hf.rms_norm_eps), after_rope=True),
    )


class HunYuanMoEV1ForCausalLM(DecoderForCausalLM):
    """Hunyuan-A13B (HF architecture HunYuanMoEV1ForCausalLM)."""

    arch_config_of = staticmethod(hunyuan_moe_arch_config)
    checkpoint_names = CheckpointNames(
        renames={
            "query_layernorm": "q_norm",
            "key_layernorm": "k_norm",
            "gate.wg": "gate",
            "shared_mlp": "shared_experts",
        }
    )
