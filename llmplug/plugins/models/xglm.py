"""XGLM: fixed sinusoidal positions (row `position + 2`), embeddings scaled by sqrt(d_model),
LayerNorm, GELU MLP (fc1, fc2), biases everywhere."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of
from llmplug.plugins.models.opt import FAIRSEQ_LAYER_RENAMES

__all__ = ["XGLMForCausalLM"]

XGLM_NAMES = CheckpointNames(prefixes={"model.layer_norm": "model.norm"}, renames=FAIRSEQ_LAYER_RENAMES)
POSITION_OFFSET = 2  # XGLM's table reserves rows for padding


def xglm_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """XGLMForCausalLM."""
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=hf.ffn_dim),
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", 1e-5, bias=True),
        mlp=MLPConfig(hf.activation_function, gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        embedding_multiplier=hf.d_model**0.5 if hf.scale_embedding else 1.0,
        embedding_multiplier_in_table=True,  # transformers' embedding module scales
        absolute_positions="sinusoidal",
        position_offset=POSITION_OFFSET,
        max_position=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class XGLMForCausalLM(DecoderForCausalLM):
    """XGLM (HF architecture XGLMForCausalLM)."""

    arch_config_of = staticmethod(xglm_arch_config)
    checkpoint_names = XGLM_NAMES
