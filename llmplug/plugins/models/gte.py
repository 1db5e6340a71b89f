"""Rotary BERTs as pooling models: NomicBERT (nomic-embed-text) and GTE (gte-multilingual, gte-v1.5).

Both are BERT's post-LN encoder with token types, but rotary positions instead of a position table
and a gated MLP. NomicBERT: SwiGLU, no biases; GTE: GeGLU with a bias on down_proj only, biased
q/k/v/o, and token types only when `type_vocab_size` > 0. Their checkpoints keep the names of the
original remote-code models (as transformers saves them too): NomicBERT's `emb_ln`, `attn.Wqkv`,
`mlp.fc11` (up) / `fc12` (gate) / `fc2`, `norm1` / `norm2`; GTE's `attention.qkv_proj`,
`mlp.up_gate_proj` ([up | gate]), `attn_ln` / `mlp_ln`, under `new.` or `gte.` in classifiers.
Their classifiers are BERT's: the pooler's dense + tanh, then `classifier`.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import QKV_CONTIGUOUS, UP_GATE, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, MLPConfig, TransformerForPooling
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.pooler import PoolingType
from llmplug.plugins.models.arch_config import layers_of, sizes_of
from llmplug.plugins.models.bert import tanh_head

__all__ = ["GteForSequenceClassification", "GteModel", "NomicBertForSequenceClassification", "NomicBertModel"]

_HEAD = {"pooler.dense": "head.dense", "classifier": "head.out_proj"}


def _names(bases: tuple[str, ...], top: dict[str, str], renames: dict[str, str], fused: dict[str, str],
           classifier: bool) -> CheckpointNames:
    """Names of a checkpoint saved bare or under one of `bases`; an embedding model drops the pooler."""
    prefixes = {**top, **{f"{base}.{k}": v for base in bases for k, v in top.items()}}
    if classifier:
        prefixes |= {**_HEAD, **{f"{base}.pooler.dense": "head.dense" for base in bases}}
    ignored = () if classifier else ("pooler.dense.weight", "pooler.dense.bias")
    return CheckpointNames(prefixes=prefixes, renames=renames, fused=fused, ignored=ignored)


def nomic_names(classifier: bool) -> CheckpointNames:
    """NomicBERT's original names."""
    top = {
        "embeddings.word_embeddings": "model.embed_tokens",
        "embeddings.token_type_embeddings": "model.embed_token_types",
        "emb_ln": "model.embed_norm",
        "encoder.layers": "model.layers",
    }
    renames = {
        "attn.Wqkv": "self_attn.qkv_proj",
        "attn.out_proj": "self_attn.o_proj",
        "mlp.fc11": "mlp.up_proj",
        "mlp.fc12": "mlp.gate_proj",
        "mlp.fc2": "mlp.down_proj",
        "norm1": "input_layernorm",
        "norm2": "post_attention_layernorm",
    }
    return _names(("nomic_bert",), top, renames, {"self_attn.qkv_proj": QKV_CONTIGUOUS}, classifier)


def gte_names(classifier: bool) -> CheckpointNames:
    """GTE's original names (Alibaba's `new` models)."""
    top = {
        "embeddings.word_embeddings": "model.embed_tokens",
        "embeddings.token_type_embeddings": "model.embed_token_types",
        "embeddings.LayerNorm": "model.embed_norm",
        "encoder.layer": "model.layers",
    }
    renames = {
        "attention.qkv_proj": "self_attn.qkv_proj",
        "attention.o_proj": "self_attn.o_proj",
        "mlp.up_gate_proj": "mlp.up_gate_proj",
        "attn_ln": "input_layernorm",
        "mlp_ln": "post_attention_layernorm",
    }
    fused = {"self_attn.qkv_proj": QKV_CONTIGUOUS, "mlp.up_gate_proj": UP_GATE}
    return _names(("new", "gte"), top, renames, fused, classifier)


def rotary_bert_fields(hf: PretrainedConfig) -> dict:
    """The fields NomicBERT and GTE share: a post-LN encoder with rotary positions."""
    return dict(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=NormConfig("layer", hf.layer_norm_eps, bias=True),
        causal=False,
        pre_norm=False,
        norm_after_residual=True,
        final_norm=False,
        embedding_norm=True,
        type_vocab_size=hf.type_vocab_size or 0,
    )


def nomic_bert_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """NomicBertModel: gated MLP of `hidden_act` (SwiGLU), no biases."""
    return DecoderArchConfig(**rotary_bert_fields(hf), mlp=MLPConfig(hf.hidden_act, gated=True, bias=False))


def gte_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """GteModel: gated MLP of `hidden_act` (GeGLU) with a bias on down_proj only; biased attention projections."""
    mlp = MLPConfig(hf.hidden_act, gated=True, bias=False, down_bias=True)
    return DecoderArchConfig(**rotary_bert_fields(hf), mlp=mlp, qkv_bias=True, o_proj_bias=True)


def _mean(hf: PretrainedConfig) -> PoolingType:
    return PoolingType.MEAN


def _cls(hf: PretrainedConfig) -> PoolingType:
    return PoolingType.CLS


class NomicBertModel(TransformerForPooling):
    """NomicBERT as an embedding model (HF architecture NomicBertModel); mean pooling by default."""

    arch_config_of = staticmethod(nomic_bert_arch_config)
    checkpoint_names = nomic_names(classifier=False)
    pooling_type_of = staticmethod(_mean)


class NomicBertForSequenceClassification(NomicBertModel):
    """NomicBERT classifiers (HF architecture NomicBertForSequenceClassification)."""

    checkpoint_names = nomic_names(classifier=True)
    head_config_of = staticmethod(tanh_head)
    pooling_type_of = staticmethod(_cls)


class GteModel(TransformerForPooling):
    """GTE as an embedding model (HF architecture GteModel); CLS pooling by default."""

    arch_config_of = staticmethod(gte_arch_config)
    checkpoint_names = gte_names(classifier=False)
    pooling_type_of = staticmethod(_cls)


class GteForSequenceClassification(GteModel):
    """GTE classifiers and rerankers (HF architecture GteForSequenceClassification)."""

    checkpoint_names = gte_names(classifier=True)
    head_config_of = staticmethod(tanh_head)
