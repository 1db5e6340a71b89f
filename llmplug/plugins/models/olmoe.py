"""OLMoE and FlexOlmo: the OLMo decoders with a mixture of experts on every layer.

OLMoE: pre-norm RMSNorm layers, RMSNorm over the whole q and k projections; router softmax top-k,
renormalised when `norm_topk_prob`. FlexOlmo: the same experts in OLMo 2's post-sublayer-norm layers.
Checkpoint names are transformers' (experts one by one).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import moe_layers, refuse
from llmplug.plugins.models.llama import llama_fields

__all__ = ["FlexOlmoForCausalLM", "OlmoeForCausalLM"]


def _olmoe_fields(hf: PretrainedConfig) -> dict[str, Any]:
    router = RouterConfig(hf.num_experts, hf.num_experts_per_tok, topk_norm=1.0 if hf.norm_topk_prob else None)
    fields = llama_fields(hf)
    bias = bool(hf.attention_bias)
    return fields | dict(
        layers=moe_layers(fields["layers"]),
        moe=MoEConfig(router, hf.intermediate_size, hf.hidden_act),
        qk_norm=QKNormConfig(NormConfig("rms", hf.rms_norm_eps), scope="projection"),
        qkv_bias=bias,
        o_proj_bias=bias,
    )


def olmoe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """OlmoeForCausalLM."""
    # OLMoE clamps after its q/k norms, the decoder (OLMo's order) before them
    refuse(hf, hf.clip_qkv is not None, "clip_qkv together with OLMoE's q/k norms")
    return DecoderArchConfig(**_olmoe_fields(hf))


def flex_olmo_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """FlexOlmoForCausalLM: norms after each sublayer (OLMo 2)."""
    return DecoderArchConfig(**_olmoe_fields(hf), pre_norm=False, post_norm=True)


class OlmoeForCausalLM(DecoderForCausalLM):
    """OLMoE (HF architecture OlmoeForCausalLM)."""

    arch_config_of = staticmethod(olmoe_arch_config)


class FlexOlmoForCausalLM(DecoderForCausalLM):
    """FlexOlmo (HF architecture FlexOlmoForCausalLM)."""

    arch_config_of = staticmethod(flex_olmo_arch_config)
