"""Llama 4 (text): interleaved rotary with chunked local attention, NoPE layers with attention temperature
tuning, an L2 q/k norm, and a mixture of experts with a shared expert on every `interleave_moe_layer_step`-th layer.

Per layer, from the config: `no_rope_layers[i]` truthy -> rotary (interleaved pairs), the weightless
RMS ("L2") q/k norm after it (`use_qk_norm`) and, with `attention_chunk_size`, chunked local attention
(`layer_types`); else NoPE: full attention whose queries are scaled by
1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) (`attn_temperature_tuning`). Routed layers
(`moe_layers`): sigmoid top-k scores applied to each expert's input, plus an always-on shared expert of
`intermediate_size`; dense layers have an MLP of `intermediate_size_mlp`. Checkpoints stack the
experts transposed (`feed_forward.experts.gate_up_proj` [E, hidden, 2 * I], `down_proj` [E, I, hidden]).
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import EXPERTS_T, STACKED_EXPERT_LEAVES, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Llama4ForCausalLM"]

CHUNKED = "chunked_attention"  # the layer type of chunked local attention in `layer_types`

LLAMA4_NAMES = CheckpointNames(
    renames={
        "feed_forward.router": "mlp.gate",
        "feed_forward.shared_expert": "mlp.shared_experts",
        "feed_forward": "mlp",
        **STACKED_EXPERT_LEAVES,
    },
    fused={"experts.gate_up_proj": EXPERTS_T, "experts.down_proj": EXPERTS_T},
)


def _layers(hf: PretrainedConfig) -> tuple[LayerConfig, ...]:
    """Each layer's rotary (or NoPE), chunk, q/k norm, query temperature and mixture of experts."""
    nope = {i for i, use_rope in enumerate(hf.no_rope_layers) if not use_rope}
    routed = set(hf.moe_layers)
    return tuple(
        replace(
            layer,
            attention_chunk=hf.attention_chunk_size if kind == CHUNKED else None,
            qk_norm=i not in nope,
            query_scale=i in nope,
            moe=i in routed,
        )
        for i, (layer, kind) in enumerate(zip(layers_of(hf, is_neox_style=False, nope_layers=nope), hf.layer_types))
    )


def llama4_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Llama4ForCausalLM (a `llama4_text` config)."""
    router = RouterConfig(hf.num_local_experts, hf.num_experts_per_tok, scoring="sigmoid", weights_on_input=True)
    moe = MoEConfig(router, hf.intermediate_size, hf.hidden_act, shared_intermediate_size=hf.intermediate_size)
    qk_norm = QKNormConfig(NormConfig("rms", hf.rms_norm_eps, has_weight=False), after_rope=True)
    temperature = (float(hf.attn_scale), int(hf.floor_scale)) if hf.attn_temperature_tuning else None
    bias = bool(hf.attention_bias)
    fields = llama_fields(hf) | {"intermediate_size": hf.intermediate_size_mlp, "layers": _layers(hf)}
    return DecoderArchConfig(
        **fields,
        moe=moe,
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=qk_norm if hf.use_qk_norm else None,
        query_position_scale=temperature,
        query_scale_offset=1,
    )


class Llama4ForCausalLM(DecoderForCausalLM):
    """Llama 4 Scout / Maverick text models (HF architecture Llama4ForCausalLM, model type llama4_text)."""

    arch_config_of = staticmethod(llama4_arch_config)
    checkpoint_names = LLAMA4_NAMES
