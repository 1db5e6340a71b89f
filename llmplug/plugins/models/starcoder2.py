"""StarCoder2: LayerNorm with bias, biases on every projection, a plain GELU MLP (c_fc, c_proj),
sliding-window attention on every layer when `sliding_window` is set."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["Starcoder2ForCausalLM"]

STARCODER2_NAMES = CheckpointNames(renames={"mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"})


def starcoder2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Starcoder2ForCausalLM."""
    bias = bool(hf.use_bias)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=NormConfig("layer", hf.norm_epsilon, bias=True),
        mlp=MLPConfig(hf.hidden_act, gated=False, bias=bias),
        qkv_bias=bias,
        o_proj_bias=bias,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class Starcoder2ForCausalLM(DecoderForCausalLM):
    """StarCoder2 (HF architecture Starcoder2ForCausalLM)."""

    arch_config_of = staticmethod(starcoder2_arch_config)
    checkpoint_names = STARCODER2_NAMES
