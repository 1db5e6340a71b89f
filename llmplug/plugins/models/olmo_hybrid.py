"""OLMo hybrid: gated delta nets on most layers (pre-norm Llama layers), OLMo 3 attention on the
`"full_attention"` layers (post-norm, RMSNorm over the whole q and k projections), rotary only when the
config has a `rope_theta` (the released checkpoints have none). Its delta nets project q, k, v, the
gate (`g_proj`), b and a separately, store a conv per q, k and v, may double beta
(`linear_allow_neg_eigval`), and use a gated norm (`o_norm`) of eps 1e-5. Checkpoints name the norms
`attention_layer_norm` (before a sublayer) and `feedforward_layer_norm` (before the MLP of a delta-net
layer, after the attention of an attention layer)."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of
from llmplug.plugins.models.llama import llama_fields
from llmplug.plugins.models.qwen3_next import gated_delta_net_config_of

__all__ = ["OlmoHybridForCausalLM"]

LINEAR = "linear_attention"
GATED_NORM_EPS = 1e-5  # fixed in transformers' OlmoHybridGatedDeltaNet
_DELTA_NET = {f"linear_attn.{p}_proj": f"mixer.in_proj_{p}" for p in "qkvba"}
OLMO_HYBRID_NAMES = CheckpointNames(
    renames={
        **_DELTA_NET,
        "linear_attn.g_proj": "mixer.in_proj_z",
        "linear_attn.o_proj": "mixer.out_proj",
        "linear_attn.o_norm": "mixer.norm",
        "linear_attn": "mixer",
        "attention_layer_norm": "input_layernorm",  # of the delta-net layers, as saved
        "feedforward_layer_norm": "post_attention_layernorm",
    }
)


def olmo_hybrid_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """OlmoHybridForCausalLM."""
    fields = llama_fields(hf)
    rope = bool((getattr(hf, "rope_parameters", None) or {}).get("rope_theta"))
    fields["layers"] = tuple(
        LayerConfig(None, mixer="gated_delta_net") if kind == LINEAR else replace(layer, post_norm=True)
        for layer, kind in zip(layers_of(hf, rope=rope), hf.layer_types)
    )
    delta_net = replace(
        gated_delta_net_config_of(hf, "separate"),
        norm_eps=GATED_NORM_EPS,
        beta_scale=2.0 if hf.linear_allow_neg_eigval else 1.0,
    )
    bias = bool(hf.attention_bias)
    qk_norm = QKNormConfig(NormConfig("rms", hf.rms_norm_eps), scope="projection")
    return DecoderArchConfig(**fields, qkv_bias=bias, o_proj_bias=bias, qk_norm=qk_norm, gated_delta_net=delta_net)


class OlmoHybridForCausalLM(DecoderForCausalLM):
    """OLMo hybrid (HF architecture OlmoHybridForCausalLM)."""

    arch_config_of = staticmethod(olmo_hybrid_arch_config)
    checkpoint_names = OLMO_HYBRID_NAMES
