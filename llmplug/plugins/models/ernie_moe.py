"""ERNIE 4.5 MoE: the Llama decoder with interleaved (GPT-J style) rotary, optional biases everywhere
(`use_bias`: attention, MLPs, lm_head), and a mixture of experts on the layers from `moe_layer_start_index` to `moe_layer_end_index`
every `moe_layer_interval`.

Router: softmax, chosen with a score-correction bias (`mlp.moe_statics.e_score_correction_bias`,
[1, E]), renormalised; logits in float32. Shared experts: `moe_num_shared_experts` of
`moe_intermediate_size`.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.moe import MoEConfig, RouterConfig
from llmplug.plugins.models.arch_config import layers_of, moe_layers
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Ernie4_5_MoeForCausalLM"]


def ernie4_5_moe_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Ernie4_5_MoeForCausalLM."""
    bias = bool(hf.use_bias)
    router = RouterConfig(hf.moe_num_experts, hf.moe_k, topk_norm=1.0, correction_bias=True, float32=True)
    size = hf.moe_intermediate_size
    moe = MoEConfig(
        router, size, hf.hidden_act, shared_intermediate_size=(hf.moe_num_shared_experts or 0) * size, shared_bias=bias
    )
    first, last, every = hf.moe_layer_start_index, hf.moe_layer_end_index, hf.moe_layer_interval
    is_moe = lambda i: (i + 1) % every == 0 and first <= i <= last  # noqa: E731
    return DecoderArchConfig(
        **llama_fields(hf)
        | {"layers": moe_layers(layers_of(hf, is_neox_style=False), is_moe), "mlp": MLPConfig(hf.hidden_act, bias=bias)},
        moe=moe,
        qkv_bias=bias,
        o_proj_bias=bias,
        lm_head_bias=bias,
    )


class Ernie4_5_MoeForCausalLM(DecoderForCausalLM):
    """ERNIE 4.5 MoE (HF architecture Ernie4_5_MoeForCausalLM)."""

    arch_config_of = staticmethod(ernie4_5_moe_arch_config)
    checkpoint_names = CheckpointNames(
        renames={"mlp.moe_statics": "mlp.gate"},
        # the multi-token-prediction block of ERNIE-4.5-*-PT checkpoints, which transformers drops too
        ignored_prefixes=("model.mtp_block", "model.mtp_emb_norm", "model.mtp_hidden_norm", "model.mtp_linear_proj"),
    )
