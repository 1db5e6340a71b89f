"""Granite 4 hybrids (GraniteMoeHybrid): Bamba's layer mix (Mamba 2 or attention, `layer_types`) with
Granite's multipliers, rotary only when `position_embedding_type == "rope"`, and the dense MLP stored as
`shared_mlp` (a fused [gate | up] `input_linear` and `output_linear`)."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import GATE_UP, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.plugins.models.arch_config import refuse
from llmplug.plugins.models.bamba import hybrid_layers, mamba2_config_of
from llmplug.plugins.models.llama import llama_fields

__all__ = ["GraniteMoeHybridForCausalLM"]

GRANITE_HYBRID_NAMES = CheckpointNames(
    renames={"mamba": "mixer", "shared_mlp.input_linear": "mlp.gate_up", "shared_mlp.output_linear": "mlp.down_proj"},
    fused={"mlp.gate_up": GATE_UP},
)


def granite_moe_hybrid_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GraniteMoeHybridForCausalLM without routed experts (`num_local_experts == 0`, e.g. Granite 4.0 H Micro)."""
    refuse(hf, hf.num_local_experts > 0, "routed experts (num_local_experts > 0) before the fused MoE layer lands")
    fields = llama_fields(hf) | {"intermediate_size": hf.shared_intermediate_size}
    attention = fields["layers"] if hf.position_embedding_type == "rope" else (LayerConfig(None),) * hf.num_hidden_layers
    fields["layers"] = hybrid_layers(attention, hf.layer_types, "mamba2")
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **fields,
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
    checkpoint_names = GRANITE_HYBRID_NAMES
