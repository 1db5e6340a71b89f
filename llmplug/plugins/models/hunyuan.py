"""Hunyuan dense (V1): the Llama decoder with RMSNorm on each q and k head applied after rotary, and NTK-alpha
rope (a `dynamic` rope with an `alpha`: the base is stretched once, independent of the sequence length)."""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import head_dim_of
from llmplug.plugins.models.llama import llama_fields

__all__ = ["HunYuanDenseV1ForCausalLM"]

HUNYUAN_NAMES = CheckpointNames(
    renames={"self_attn.query_layernorm": "self_attn.q_norm", "self_attn.key_layernorm": "self_attn.k_norm"}
)


def _ntk_alpha_layers(hf: PretrainedConfig, layers: tuple[LayerConfig, ...]) -> tuple[LayerConfig, ...]:
    """The layers with NTK-alpha's plain rope of base theta * alpha^(d / (d - 2)), where the rope has an alpha."""
    rope = hf.rope_parameters
    if rope.get("rope_type") != "dynamic" or not rope.get("alpha"):
        return layers
    d = head_dim_of(hf)
    theta = rope["rope_theta"] * rope["alpha"] ** (d / (d - 2))
    return tuple(
        dataclasses.replace(layer, rope=dataclasses.replace(layer.rope, theta=theta, scaling=None)) for layer in layers
    )


def hunyuan_dense_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """HunYuanDenseV1ForCausalLM."""
    bias = bool(hf.attention_bias)
    fields = llama_fields(hf)
    qk_norm = QKNormConfig(NormConfig("rms", hf.rms_norm_eps), after_rope=True)
    return DecoderArchConfig(
        **fields | {"layers": _ntk_alpha_layers(hf, fields["layers"])}, qkv_bias=bias, o_proj_bias=bias, qk_norm=qk_norm
    )


class HunYuanDenseV1ForCausalLM(DecoderForCausalLM):
    """Hunyuan dense (HF architecture HunYuanDenseV1ForCausalLM)."""

    arch_config_of = staticmethod(hunyuan_dense_arch_config)
    checkpoint_names = HUNYUAN_NAMES
