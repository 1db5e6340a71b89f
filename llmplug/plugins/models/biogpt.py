"""BioGPT: fairseq's pre-norm decoder layer (as OPT's, with its names), embeddings scaled by sqrt(hidden) when
`scale_embedding`, learned positions read from row `position + 2`, GELU MLP, biases everywhere, LayerNorms of
eps 1e-5 (the config's `layer_norm_eps` is unused by transformers)."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of
from llmplug.plugins.models.opt import FAIRSEQ_LAYER_RENAMES, POSITION_OFFSET

__all__ = ["BioGptForCausalLM"]

BIOGPT_NAMES = CheckpointNames(
    prefixes={
        "biogpt.embed_tokens": "model.embed_tokens",
        "biogpt.embed_positions": "model.embed_positions",
        "biogpt.layers": "model.layers",
        "biogpt.layer_norm": "model.norm",
        "output_projection": "lm_head",
    },
    renames=FAIRSEQ_LAYER_RENAMES,
)
LAYER_NORM_EPS = 1e-5  # transformers' BioGPT builds its LayerNorms with the default eps


def biogpt_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """BioGptForCausalLM."""
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", LAYER_NORM_EPS, bias=True),
        mlp=MLPConfig(hf.hidden_act, gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        embedding_multiplier=hf.hidden_size**0.5 if hf.scale_embedding else 1.0,
        embedding_multiplier_in_table=True,  # transformers' embedding module scales
        absolute_positions="learned",
        position_offset=POSITION_OFFSET,
        max_position=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class BioGptForCausalLM(DecoderForCausalLM):
    """BioGPT (HF architecture BioGptForCausalLM)."""

    arch_config_of = staticmethod(biogpt_arch_config)
    checkpoint_names = BIOGPT_NAMES
