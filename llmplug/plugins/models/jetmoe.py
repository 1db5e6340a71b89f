"""JetMoe: a mixture of attention heads (routed query / output projections over shared k/v) and a
mixture-of-experts MLP on every layer, both with an output bias.

Both routers: top-k of the logits, softmax over those k. The checkpoint stacks every expert:
`self_attention.experts.input_linear` [E, Hkv * D, hidden] (queries), `output_linear` [E, hidden, Hkv * D],
`self_attention.kv_proj` [k | v]; the MLP's `input_linear` [E, 2 * I, hidden] ([gate | up]) and
`output_linear` [E, hidden, I].
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import EXPERTS, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.plugins.models.arch_config import layers_of, moe_layers, refuse, sizes_of

__all__ = ["JetMoeForCausalLM"]

LAYER_NORM_EPS = 1e-6  # transformers builds JetMoe's per-layer norms with the default eps, whatever the config says

JETMOE_NAMES = CheckpointNames(
    renames={
        "self_attention.experts.input_linear": "self_attn.q_experts",
        "self_attention.experts.output_linear": "self_attn.o_experts",
        "self_attention.experts.router.layer": "self_attn.router",
        "self_attention.experts.bias": "self_attn.bias",
        "self_attention.kv_proj": "self_attn.kv_proj",
        "mlp.router.layer": "mlp.gate",
        "mlp.input_linear": "mlp.experts.gate_up_proj",
        "mlp.output_linear": "mlp.experts.down_proj",
    },
    fused={"experts.gate_up_proj": EXPERTS, "experts.down_proj": EXPERTS},
)


def jetmoe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """JetMoeForCausalLM: `kv_channels`-wide heads, top_k * num_key_value_heads query heads per token."""
    eps = hf.rms_norm_eps
    refuse(hf, eps != LAYER_NORM_EPS, f"rms_norm_eps={eps} (its layer norms use {LAYER_NORM_EPS})")
    router = RouterConfig(hf.num_local_experts, hf.num_experts_per_tok, topk_norm=1.0)
    moe = MoEConfig(router, hf.intermediate_size, hf.activation_function, output_bias=True)
    return DecoderArchConfig(
        **sizes_of(hf) | {"head_dim": hf.kv_channels},
        layers=moe_layers(layers_of(hf)),
        norm=NormConfig("rms", hf.rms_norm_eps),
        moe=moe,
        attention_experts=router,
        o_proj_bias=True,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class JetMoeForCausalLM(DecoderForCausalLM):
    """JetMoe (HF architecture JetMoeForCausalLM)."""

    arch_config_of = staticmethod(jetmoe_arch_config)
    checkpoint_names = JETMOE_NAMES
