"""The BERT family as pooling models: BERT, RoBERTa, XLM-RoBERTa — the generic transformer as an encoder.

An encoder layer is the generic one with bidirectional attention (`causal=False`) and a LayerNorm
after each residual add (`norm_after_residual`); tokens, learned positions and token types are summed
and normalized (`embedding_norm`), with no final norm. RoBERTa's positions start at pad_token_id + 1
(`position_offset`), so a prompt holding the pad token is placed as if it held none. `*Model`
checkpoints embed (CLS pooling unless a sentence-transformers folder says otherwise);
`*ForSequenceClassification` classify through a dense + tanh head: BERT's pooler, RoBERTa's
classification head.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, MLPConfig, TransformerForPooling
from llmplug.layers.decoder.pooling import classifier_activation
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.pooler import ClassifierHeadConfig, PoolingType
from llmplug.plugins.models.arch_config import layers_of, refuse, sizes_of

__all__ = [
    "BertForSequenceClassification",
    "BertModel",
    "RobertaForSequenceClassification",
    "RobertaModel",
    "XLMRobertaForSequenceClassification",
    "XLMRobertaModel",
    "encoder_names",
]

_LAYER_RENAMES = {
    "attention.self.query": "self_attn.q_proj",
    "attention.self.key": "self_attn.k_proj",
    "attention.self.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.o_proj",
    "attention.output.LayerNorm": "input_layernorm",
    "intermediate.dense": "mlp.up_proj",
    "output.dense": "mlp.down_proj",
    "output.LayerNorm": "post_attention_layernorm",
    "gamma": "weight",  # LayerNorms of checkpoints converted from TensorFlow
    "beta": "bias",
}
_EMBEDDINGS = {
    "embeddings.word_embeddings": "model.embed_tokens",
    "embeddings.position_embeddings": "model.embed_positions",
    "embeddings.token_type_embeddings": "model.embed_token_types",
    "embeddings.LayerNorm": "model.embed_norm",
    "encoder.layer": "model.layers",
}


def encoder_names(base: str, head: dict[str, str] | None, renames: dict[str, str] = _LAYER_RENAMES) -> CheckpointNames:
    """Names of a BERT-like checkpoint saved with or without its base-model prefix (`bert.`, `roberta.`).

    `head`: checkpoint module -> `head.*` for a classifier; None for an embedding model, which drops the
    base model's pooler.
    """
    prefixes = {**_EMBEDDINGS, **{f"{base}.{k}": v for k, v in _EMBEDDINGS.items()}}
    ignored: tuple[str, ...] = ("embeddings.position_ids",)
    if head is None:
        ignored += ("pooler.dense.weight", "pooler.dense.bias")
    return CheckpointNames(prefixes={**prefixes, **(head or {})}, renames=renames, ignored=ignored)


def bert_arch_config(hf: PretrainedConfig, position_offset: int = 0) -> DecoderArchConfig:
    """BertModel and relatives: post-LN encoder layers, learned positions from row `position_offset`."""
    kind = getattr(hf, "position_embedding_type", None) or "absolute"
    refuse(hf, kind != "absolute", f"position_embedding_type={kind!r}")
    refuse(hf, bool(getattr(hf, "is_decoder", False)), "is_decoder=True (a BERT decoder)")
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", hf.layer_norm_eps, bias=True),
        mlp=MLPConfig(hf.hidden_act, gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        causal=False,
        pre_norm=False,
        norm_after_residual=True,
        final_norm=False,
        embedding_norm=True,
        absolute_positions="learned",
        position_offset=position_offset,
        max_position=hf.max_position_embeddings - position_offset,
        type_vocab_size=hf.type_vocab_size,
    )


def roberta_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """RobertaModel, XLMRobertaModel: BERT with positions counted from pad_token_id + 1."""
    return bert_arch_config(hf, position_offset=hf.pad_token_id + 1)


def tanh_head(hf: PretrainedConfig) -> ClassifierHeadConfig:
    """dense -> tanh -> labels: BERT's pooler + classifier, RoBERTa's classification head."""
    return ClassifierHeadConfig(hf.num_labels, dense=True, activation=classifier_activation(hf))


def _cls(hf: PretrainedConfig) -> PoolingType:
    return PoolingType.CLS


_BERT_HEAD = {"bert.pooler.dense": "head.dense", "pooler.dense": "head.dense", "classifier": "head.out_proj"}
_ROBERTA_HEAD = {"classifier.dense": "head.dense", "classifier.out_proj": "head.out_proj"}


class BertModel(TransformerForPooling):
    """BERT as an embedding model (HF architecture BertModel; all-MiniLM, BGE, E5, ...)."""

    arch_config_of = staticmethod(bert_arch_config)
    checkpoint_names = encoder_names("bert", None)
    pooling_type_of = staticmethod(_cls)


class BertForSequenceClassification(BertModel):
    """BERT classifiers and cross-encoders (HF architecture BertForSequenceClassification)."""

    checkpoint_names = encoder_names("bert", _BERT_HEAD)
    head_config_of = staticmethod(tanh_head)


class RobertaModel(TransformerForPooling):
    """RoBERTa as an embedding model (HF architecture RobertaModel)."""

    arch_config_of = staticmethod(roberta_arch_config)
    checkpoint_names = encoder_names("roberta", None)
    pooling_type_of = staticmethod(_cls)


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa classifiers and cross-encoders (HF architecture RobertaForSequenceClassification)."""

    checkpoint_names = encoder_names("roberta", _ROBERTA_HEAD)
    head_config_of = staticmethod(tanh_head)


class XLMRobertaModel(RobertaModel):
    """XLM-RoBERTa as an embedding model (HF architecture XLMRobertaModel; multilingual E5, BGE-M3)."""


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    """XLM-RoBERTa classifiers and rerankers (HF architecture XLMRobertaForSequenceClassification; BGE reranker)."""
