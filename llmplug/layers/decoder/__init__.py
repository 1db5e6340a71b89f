"""The generic decoder-only transformer every dense decoder family is a config of.

Exports the typed config (`DecoderArchConfig`, `LayerConfig`, `MLPConfig`, `MLAConfig`, `RopeConfig`,
`HeadTransformConfig`), the model (`DecoderForCausalLM`, `DecoderModel`; `TransformerForPooling` for
embeddings and classifiers, encoders included) and its blocks (`DecoderLayer`, `DecoderAttention`,
`LatentAttention`, `DecoderMLP`; the mixture-of-experts MLP is llmplug.layers.moe). A family plugin writes
an adapter from its HF config to a `DecoderArchConfig` and,
when its checkpoint names differ from transformers' Llama names, a `CheckpointNames`
(llmplug.layers.checkpoint_names); see docs/models.md.
"""

from llmplug.layers.decoder.arch import (
    DecoderArchConfig,
    HeadTransformConfig,
    LayerConfig,
    MLAConfig,
    MLPConfig,
    RopeConfig,
)
from llmplug.layers.decoder.attention import DecoderAttention
from llmplug.layers.decoder.layer import DecoderLayer
from llmplug.layers.decoder.mla import LatentAttention
from llmplug.layers.decoder.mlp import DecoderMLP
from llmplug.layers.decoder.model import DecoderForCausalLM, DecoderModel, stacked_params
from llmplug.layers.decoder.pooling import TransformerForPooling, as_pooling_model

__all__ = [
    "DecoderArchConfig",
    "DecoderAttention",
    "DecoderForCausalLM",
    "DecoderLayer",
    "DecoderMLP",
    "DecoderModel",
    "HeadTransformConfig",
    "LatentAttention",
    "LayerConfig",
    "MLAConfig",
    "MLPConfig",
    "RopeConfig",
    "TransformerForPooling",
    "as_pooling_model",
    "stacked_params",
]
