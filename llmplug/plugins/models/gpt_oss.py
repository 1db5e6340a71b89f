"""GPT-OSS: attention with sinks, biases and alternating sliding windows; a mixture of experts on every layer.

Router: logits with a bias, top-k, softmax over those k. Experts: GPT-OSS's clamped SwiGLU with
biases; the checkpoint stacks them, gate and up columns interleaved (`experts.gate_up_proj`
[E, hidden, 2 * I]) and down transposed (`experts.down_proj` [E, I, hidden]).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import (
    EXPERTS_T,
    EXPERTS_T_INTERLEAVED,
    STACKED_EXPERT_LEAVES,
    CheckpointNames,
)
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.plugins.models.arch_config import moe_layers
from llmplug.plugins.models.llama import llama_fields

__all__ = ["GptOssForCausalLM"]

GPT_OSS_NAMES = CheckpointNames(
    renames={"mlp.router": "mlp.gate", "self_attn.sinks": "self_attn.attn.sinks", **STACKED_EXPERT_LEAVES},
    fused={"experts.gate_up_proj": EXPERTS_T_INTERLEAVED, "experts.down_proj": EXPERTS_T},
)


def gpt_oss_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GptOssForCausalLM."""
    router = RouterConfig(hf.num_local_experts, hf.num_experts_per_tok, topk_norm=1.0, bias=True)
    moe = MoEConfig(
        router, hf.intermediate_size, expert_bias=True, swiglu_limit=hf.swiglu_limit, swiglu_alpha=hf.swiglu_alpha
    )
    fields = llama_fields(hf)
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **fields | {"layers": moe_layers(fields["layers"])},
        moe=moe,
        qkv_bias=bias,
        o_proj_bias=bias,
        attention_sinks=True,
    )


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss (HF architecture GptOssForCausalLM)."""

    arch_config_of = staticmethod(gpt_oss_arch_config)
    checkpoint_names = GPT_OSS_NAMES
