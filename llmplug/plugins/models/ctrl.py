"""CTRL (Salesforce): embeddings scaled by sqrt(d) plus the Transformer paper's sinusoidal positions, pre-norm
LayerNorm, ReLU MLP, biases everywhere, a tied LM head with a bias. Hub checkpoints may lack the `transformer.`
prefix; both spellings load."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, refuse, sizes_of

__all__ = ["CTRLLMHeadModel"]

_TOP = {"w": "model.embed_tokens", "h": "model.layers", "layernorm": "model.norm"}
CTRL_NAMES = CheckpointNames(
    prefixes={**_TOP, **{f"transformer.{k}": v for k, v in _TOP.items()}},
    renames={
        "multi_head_attention.Wq": "self_attn.q_proj",
        "multi_head_attention.Wk": "self_attn.k_proj",
        "multi_head_attention.Wv": "self_attn.v_proj",
        "multi_head_attention.dense": "self_attn.o_proj",
        "ffn.0": "mlp.up_proj",
        "ffn.2": "mlp.down_proj",
        "layernorm1": "input_layernorm",
        "layernorm2": "post_attention_layernorm",
    },
)
LAYER_NORM_EPS = 1e-6  # fixed in transformers' CTRL layers; the config's applies to the final norm only


def ctrl_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """CTRLLMHeadModel."""
    refuse(hf, hf.layer_norm_epsilon != LAYER_NORM_EPS, f"layer_norm_epsilon other than {LAYER_NORM_EPS}")
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=hf.dff),
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", LAYER_NORM_EPS, bias=True),
        mlp=MLPConfig("relu", gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        embedding_multiplier=hf.hidden_size**0.5,
        absolute_positions="sinusoidal_paper",
        max_position=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        lm_head_bias=True,
    )


class CTRLLMHeadModel(DecoderForCausalLM):
    """CTRL (HF architecture CTRLLMHeadModel)."""

    arch_config_of = staticmethod(ctrl_arch_config)
    checkpoint_names = CTRL_NAMES
