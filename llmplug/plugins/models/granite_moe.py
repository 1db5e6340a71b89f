"""GraniteMoe, GraniteMoeShared and GraniteMoeSWA: Granite's multipliers with a mixture of experts on every layer.

Router: top-k of the logits, softmax over those k (the renormalised softmax). The checkpoints stack
the experts: `block_sparse_moe.input_linear` [E, 2 * I, hidden] ([gate | up]) and `output_linear`
[E, hidden, I]. GraniteMoeShared adds an ungated shared MLP (`shared_mlp`, fused input_linear);
GraniteMoeSWA adds sinks, windowed layers (`layer_types`) and a rope base per layer
(`layer_rope_theta`, 0: no rotary).
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import EXPERTS, GATE_UP, STACKED_EXPERT_LEAVES, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.plugins.models.arch_config import moe_layers
from llmplug.plugins.models.granite import granite_arch_config

__all__ = ["GraniteMoeForCausalLM", "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM"]

_SHARED_MLP = {
    "shared_mlp.input_linear": "mlp.shared_experts.gate_up",
    "shared_mlp.output_linear": "mlp.shared_experts.down_proj",
}
_FUSED = {"experts.gate_up_proj": EXPERTS, "experts.down_proj": EXPERTS, "shared_experts.gate_up": GATE_UP}
GRANITE_MOE_NAMES = CheckpointNames(
    renames={
        "block_sparse_moe": "mlp",
        "router.layer": "gate",
        "input_linear": "experts.gate_up_proj",
        "output_linear": "experts.down_proj",
        **_SHARED_MLP,
    },
    fused=_FUSED,
)
# GraniteMoeSWA checkpoints hold transformers' in-memory names (stacked `experts.gate_up_proj`, `router`)
GRANITE_MOE_SWA_NAMES = CheckpointNames(
    renames={
        "block_sparse_moe": "mlp",
        "router": "gate",
        "self_attn.sinks": "self_attn.attn.sinks",
        **STACKED_EXPERT_LEAVES,
        **_SHARED_MLP,
    },
    fused=_FUSED,
)


def granite_moe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GraniteMoeForCausalLM, and GraniteMoeShared's shared MLP when `shared_intermediate_size` is set."""
    arch = granite_arch_config(hf)
    router = RouterConfig(hf.num_local_experts, hf.num_experts_per_tok, topk_norm=1.0)
    shared = getattr(hf, "shared_intermediate_size", 0)
    moe = MoEConfig(router, hf.intermediate_size, hf.hidden_act, shared_intermediate_size=shared)
    return replace(arch, layers=moe_layers(arch.layers), moe=moe)


def granite_moe_swa_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GraniteMoeSWAForCausalLM: sinks, windows by layer type, a rope base per layer (0: NoPE)."""
    arch = granite_moe_arch_config(hf)
    layers = tuple(_with_theta(layer, theta) for layer, theta in zip(arch.layers, hf.layer_rope_theta))
    return replace(arch, layers=layers, attention_sinks=True)


def _with_theta(layer: LayerConfig, theta: float) -> LayerConfig:
    return replace(layer, rope=replace(layer.rope, theta=float(theta)) if theta else None)


class GraniteMoeForCausalLM(DecoderForCausalLM):
    """Granite 3.0 MoE (HF architecture GraniteMoeForCausalLM)."""

    arch_config_of = staticmethod(granite_moe_arch_config)
    checkpoint_names = GRANITE_MOE_NAMES


class GraniteMoeSharedForCausalLM(DecoderForCausalLM):
    """Granite MoE with a shared expert (HF architecture GraniteMoeSharedForCausalLM)."""

    arch_config_of = staticmethod(granite_moe_arch_config)
    checkpoint_names = GRANITE_MOE_NAMES


class GraniteMoeSWAForCausalLM(DecoderForCausalLM):
    """Granite MoE with sliding windows and sinks (HF architecture GraniteMoeSWAForCausalLM)."""

    arch_config_of = staticmethod(granite_moe_swa_arch_config)
    checkpoint_names = GRANITE_MOE_SWA_NAMES
