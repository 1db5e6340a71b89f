"""MiniMax-M2: OLMo 2-style q/k RMSNorm over the whole projections, partial rotary, and a mixture of
experts on every layer routed by sigmoid scores with a score-correction bias, renormalised.

Checkpoint names are Mixtral's (`block_sparse_moe.experts.<e>.w1/w2/w3`); the correction bias sits on
the block (`block_sparse_moe.e_score_correction_bias`).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import moe_layers
from llmplug.plugins.models.llama import llama_fields
from llmplug.plugins.models.mixtral import MIXTRAL_NAMES

__all__ = ["MiniMaxM2ForCausalLM"]

# hub checkpoints: `block_sparse_moe.*`; transformers' own names (a GGUF file's, via the gguf loader): `mlp.*`
MINIMAX_M2_NAMES = CheckpointNames(
    renames={
        "block_sparse_moe.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
        "mlp.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
        **MIXTRAL_NAMES.renames,
    }
)


def minimax_m2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """MiniMaxM2ForCausalLM."""
    router = RouterConfig(
        hf.num_local_experts, hf.num_experts_per_tok, "sigmoid", topk_norm=1.0, correction_bias=True
    )
    fields = llama_fields(hf)
    return DecoderArchConfig(
        **fields | {"layers": moe_layers(fields["layers"])},
        moe=MoEConfig(router, hf.intermediate_size, hf.hidden_act),
        qk_norm=QKNormConfig(NormConfig("rms", hf.rms_norm_eps), scope="projection"),
    )


class MiniMaxM2ForCausalLM(DecoderForCausalLM):
    """MiniMax-M2 (HF architecture MiniMaxM2ForCausalLM)."""

    arch_config_of = staticmethod(minimax_m2_arch_config)
    checkpoint_names = MINIMAX_M2_NAMES
