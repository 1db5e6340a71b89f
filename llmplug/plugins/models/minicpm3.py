"""MiniCPM3: DeepSeek V2's latent attention (rotate-half rotary) with a dense MLP, and MiniCPM's scalings:
embeddings x `scale_emb`, each sublayer's output x `scale_depth` / sqrt(layers) before the residual add,
logits x `dim_model_base` / hidden (transformers divides the hidden states before the tied head)."""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.plugins.models.deepseek import mla_config_of, mla_scale
from llmplug.plugins.models.llama import llama_fields

__all__ = ["MiniCPM3ForCausalLM"]


def minicpm3_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """MiniCPM3ForCausalLM."""
    return DecoderArchConfig(
        **llama_fields(hf),
        mla=mla_config_of(hf),
        attention_scale=mla_scale(hf),
        o_proj_bias=bool(hf.attention_bias),
        embedding_multiplier=hf.scale_emb,
        embedding_multiplier_in_table=True,  # transformers' embedding module scales
        residual_multiplier=hf.scale_depth / math.sqrt(hf.num_hidden_layers),
        logits_multiplier=hf.dim_model_base / hf.hidden_size,
    )


class MiniCPM3ForCausalLM(DecoderForCausalLM):
    """MiniCPM3 (HF architecture MiniCPM3ForCausalLM)."""

    arch_config_of = staticmethod(minicpm3_arch_config)
