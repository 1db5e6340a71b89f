"""ModernBERT as pooling models: a pre-norm encoder with rotary positions, GeGLU and bias-free LayerNorms.

Layers alternate global attention and local attention over keys |i - j| <= local_attention / 2, each
kind with its own rope theta; the first layer has no norm before attention (the embeddings are
normalized already). q/k/v (`Wqkv`) and the GLU's input and gate (`Wi`) are fused in the checkpoint.
The classifier head is dense -> activation -> LayerNorm -> labels, over the CLS row or the mean
(`classifier_pooling`).
"""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import GATE_UP, QKV_CONTIGUOUS, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, MLPConfig, TransformerForPooling
from llmplug.layers.decoder.pooling import classifier_activation
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.pooler import ClassifierHeadConfig, PoolingType
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["ModernBertForSequenceClassification", "ModernBertModel"]

_TOP = {
    "embeddings.tok_embeddings": "model.embed_tokens",
    "embeddings.norm": "model.embed_norm",
    "final_norm": "model.norm",
    "layers": "model.layers",
}


def _names(head: dict[str, str] | None) -> CheckpointNames:
    return CheckpointNames(
        prefixes={**_TOP, **{f"model.{k}": v for k, v in _TOP.items()}, **(head or {})},
        renames={
            "attn.Wqkv": "self_attn.qkv_proj",
            "attn.Wo": "self_attn.o_proj",
            "attn_norm": "input_layernorm",
            "mlp_norm": "post_attention_layernorm",
            "mlp.Wi": "mlp.gate_up_proj",
            "mlp.Wo": "mlp.down_proj",
        },
        fused={"self_attn.qkv_proj": QKV_CONTIGUOUS, "mlp.gate_up_proj": GATE_UP},
    )


def _norm(hf: PretrainedConfig) -> NormConfig:
    return NormConfig("layer", hf.norm_eps, bias=hf.norm_bias)


def modernbert_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """ModernBertModel: the local layers' window is local_attention / 2 keys each way."""
    layers = layers_of(hf, window=hf.local_attention // 2 + 1)
    layers = (dataclasses.replace(layers[0], input_norm=False), *layers[1:])
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers,
        norm=_norm(hf),
        mlp=MLPConfig(hf.hidden_activation, gated=True, bias=hf.mlp_bias),
        qkv_bias=hf.attention_bias,
        o_proj_bias=hf.attention_bias,
        causal=False,
        embedding_norm=True,
    )


def modernbert_head(hf: PretrainedConfig) -> ClassifierHeadConfig:
    """dense -> classifier_activation -> LayerNorm -> labels."""
    return ClassifierHeadConfig(
        hf.num_labels,
        dense=True,
        dense_bias=hf.classifier_bias,
        dense_activation=hf.classifier_activation,
        norm=_norm(hf),
        activation=classifier_activation(hf),
    )


def modernbert_pooling(hf: PretrainedConfig) -> PoolingType:
    """`classifier_pooling`: cls or mean."""
    return PoolingType.MEAN if hf.classifier_pooling == "mean" else PoolingType.CLS


class ModernBertModel(TransformerForPooling):
    """ModernBERT as an embedding model (HF architecture ModernBertModel; gte-modernbert, nomic-modernbert)."""

    arch_config_of = staticmethod(modernbert_arch_config)
    checkpoint_names = _names(None)
    pooling_type_of = staticmethod(modernbert_pooling)


class ModernBertForSequenceClassification(ModernBertModel):
    """ModernBERT classifiers and rerankers (HF architecture ModernBertForSequenceClassification)."""

    checkpoint_names = _names({"head.dense": "head.dense", "head.norm": "head.norm", "classifier": "head.out_proj"})
    head_config_of = staticmethod(modernbert_head)
