"""GPT-J and CodeGen: one LayerNorm feeding attention and MLP in parallel, interleaved (GPT-J style) partial
rotary, GELU MLP, an LM head with a bias. CodeGen stores q/k/v in one `qkv_proj` in its own block layout."""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import QKV_CODEGEN, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import head_dim_of, layers_of, sizes_of

__all__ = ["CodeGenForCausalLM", "GPTJForCausalLM"]

GPTJ_NAMES = CheckpointNames(
    prefixes={
        "transformer.wte": "model.embed_tokens",
        "transformer.h": "model.layers",
        "transformer.ln_f": "model.norm",
    },
    renames={
        "ln_1": "input_layernorm",
        "attn": "self_attn",
        "out_proj": "o_proj",
        "mlp.fc_in": "mlp.up_proj",
        "mlp.fc_out": "mlp.down_proj",
    },
    ignored=("attn.bias", "attn.masked_bias"),
)
CODEGEN_NAMES = dataclasses.replace(
    GPTJ_NAMES, fused={"self_attn.qkv_proj": QKV_CODEGEN}, ignored=(*GPTJ_NAMES.ignored, "attn.causal_mask")
)


def gptj_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GPTJForCausalLM: `rotary_dim` leading dims of each head rotated in interleaved pairs."""
    head_dim = head_dim_of(hf)
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=hf.n_inner or 4 * hf.hidden_size),
        layers=layers_of(hf, is_neox_style=False, partial_rotary_factor=(hf.rotary_dim or head_dim) / head_dim),
        norm=NormConfig("layer", hf.layer_norm_epsilon, bias=True),
        mlp=MLPConfig(hf.activation_function, gated=False, bias=True),
        parallel_residual=True,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        lm_head_bias=True,
    )


class GPTJForCausalLM(DecoderForCausalLM):
    """GPT-J (HF architecture GPTJForCausalLM)."""

    arch_config_of = staticmethod(gptj_arch_config)
    checkpoint_names = GPTJ_NAMES


class CodeGenForCausalLM(DecoderForCausalLM):
    """CodeGen (HF architecture CodeGenForCausalLM): GPT-J with a fused q/k/v projection."""

    arch_config_of = staticmethod(gptj_arch_config)
    checkpoint_names = CODEGEN_NAMES
