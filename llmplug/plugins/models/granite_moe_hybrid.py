"""Granite 4 hybrids (GraniteMoeHybrid): Bamba's layer mix (Mamba 2 or attention, `layer_types`) with
Granite's multipliers, rotary only when `position_embedding_type == "rope"`, and GraniteMoeShared's MLP:
routed experts (`num_local_experts`, stacked `block_sparse_moe` tensors) plus a shared MLP
(`shared_mlp`, a fused [gate | up] `input_linear`), or the shared MLP alone when there are no experts
(Granite 4.0 H Micro)."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import GATE_UP, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.plugins.models.arch_config import moe_layers
from llmplug.plugins.models.bamba import hybrid_layers, mamba2_config_of
from llmplug.plugins.models.granite_moe import GRANITE_MOE_NAMES
from llmplug.plugins.models.llama import llama_fields

__all__ = ["GraniteMoeHybridForCausalLM"]

_DENSE_NAMES = CheckpointNames(
    renames={"mamba": "mixer", "shared_mlp.input_linear": "mlp.gate_up", "shared_mlp.output_linear": "mlp.down_proj"},
    fused={"mlp.gate_up": GATE_UP},
)
_MOE_NAMES = replace(GRANITE_MOE_NAMES, renames={**GRANITE_MOE_NAMES.renames, "mamba": "mixer"})


def granite_moe_hybrid_names(hf: PretrainedConfig) -> CheckpointNames:
    """With experts the shared MLP is the MoE block's shared experts, without them the layer's MLP."""
    return _MOE_NAMES if hf.num_local_experts else _DENSE_NAMES


def granite_moe_hybrid_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GraniteMoeHybridForCausalLM."""
    shared = hf.shared_intermediate_size
    fields = llama_fields(hf) | {"intermediate_size": shared}
    rope = hf.position_embedding_type == "rope"
    attention = fields["layers"] if rope else (LayerConfig(None),) * hf.num_hidden_layers
    layers = hybrid_layers(attention, hf.layer_types, "mamba2")
    moe = None
    if hf.num_local_experts:
        router = RouterConfig(hf.num_local_experts, hf.num_experts_per_tok, topk_norm=1.0)
        moe = MoEConfig(router, hf.intermediate_size, hf.hidden_act, shared_intermediate_size=shared)
        layers = moe_layers(layers)
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **fields | {"layers": layers},
        moe=moe,
        qkv_bias=bias,
        o_proj_bias=bias,
        mamba2=mamba2_config_of(hf),
        attention_scale=hf.attention_multiplier,
        embedding_multiplier=hf.embedding_multiplier,
        residual_multiplier=hf.residual_multiplier,
        logits_multiplier=1.0 / hf.logits_scaling,
    )


class GraniteMoeHybridForCausalLM(DecoderForCausalLM):
    """Granite 4.0 hybrids (HF architecture GraniteMoeHybridForCausalLM)."""

    arch_config_of = staticmethod(granite_moe_hybrid_arch_config)
    checkpoint_names_of = staticmethod(granite_moe_hybrid_names)
