"""The BERT family as pooling models: BERT, RoBERTa, XLM-RoBERTa — the generic transformer as an encoder.

An encoder layer is the generic one with bidirectional attention (`causal=False`) and a LayerNorm
after each residual add (`norm_after_residual`); tokens, learned positions and token types are summed
and normalized (`embedding_norm`), with no final norm. RoBERTa's positions start at pad_token_id + 1
(`position_offset`), so a prompt holding the pad token is placed as if it held none. `*Model`
checkpoints embed (CLS pooling unless a sentence-transformers folder says otherwise);
`*ForSequenceClassification` classify through a dense + tanh head: BERT's pooler, RoBERTa's
classification head. `*ForCausalLM` / BertLMHeadModel are the same layers made causal (`is_decoder=True`)
under the masked-LM prediction head (dense -> activation -> LayerNorm, `head_transform`) and a tied decoder
with a bias. Three relatives are pre-LN (a LayerNorm before each sublayer and one after the last layer):
RoBERTa-PreLayerNorm (embeddings normalized too), XLM-RoBERTa-XL and Megatron-BERT (embeddings not).
"""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import (
    DecoderArchConfig,
    DecoderForCausalLM,
    HeadTransformConfig,
    MLPConfig,
    TransformerForPooling,
)
from llmplug.layers.decoder.pooling import classifier_activation
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.pooler import ClassifierHeadConfig, PoolingType
from llmplug.plugins.models.arch_config import layers_of, refuse, sizes_of

__all__ = [
    "BertForSequenceClassification",
    "BertLMHeadModel",
    "BertModel",
    "CamembertForCausalLM",
    "Data2VecTextForCausalLM",
    "MegatronBertForCausalLM",
    "RobertaForCausalLM",
    "RobertaForSequenceClassification",
    "RobertaModel",
    "RobertaPreLayerNormForCausalLM",
    "XLMRobertaForCausalLM",
    "XLMRobertaForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaXLForCausalLM",
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


def encoder_names(
    base: str, head: dict[str, str] | None, renames: dict[str, str] = _LAYER_RENAMES, final_norm: str | None = None
) -> CheckpointNames:
    """Names of a BERT-like checkpoint saved with or without its base-model prefix (`bert.`, `roberta.`).

    `head`: checkpoint module -> `head.*` for a classifier; None for an embedding model, which drops the
    base model's pooler. `final_norm`: the base model's module of a pre-LN model's last norm.
    """
    body = _EMBEDDINGS | ({} if final_norm is None else {final_norm: "model.norm"})
    prefixes = {**body, **{f"{base}.{k}": v for k, v in body.items()}}
    ignored: tuple[str, ...] = ("embeddings.position_ids",)
    if head is None:
        ignored += ("pooler.dense.weight", "pooler.dense.bias")
    return CheckpointNames(prefixes={**prefixes, **(head or {})}, renames=renames, ignored=ignored)


def bert_arch_config(hf: PretrainedConfig, position_offset: int = 0, causal: bool = False) -> DecoderArchConfig:
    """BertModel and relatives: post-LN encoder layers, learned positions from row `position_offset`."""
    kind = getattr(hf, "position_embedding_type", None) or "absolute"
    refuse(hf, kind != "absolute", f"position_embedding_type={kind!r}")
    if not causal:
        refuse(hf, bool(getattr(hf, "is_decoder", False)), "is_decoder=True (a BERT decoder)")
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", hf.layer_norm_eps, bias=True),
        mlp=MLPConfig(hf.hidden_act, gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        causal=causal,
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


def causal_lm_arch_config(
    hf: PretrainedConfig, position_offset: int = 0, head_act: str | None = None
) -> DecoderArchConfig:
    """BertLMHeadModel and relatives: the encoder made causal under its masked-LM prediction head, whose
    activation is `hidden_act` (BERT) or `head_act` (RoBERTa's, fixed to GELU)."""
    refuse(hf, not getattr(hf, "is_decoder", False), "is_decoder=False (a masked LM, not a causal one)")
    cross = bool(getattr(hf, "add_cross_attention", False))
    refuse(hf, cross, "add_cross_attention=True (the decoder of an encoder-decoder)")
    return dataclasses.replace(
        bert_arch_config(hf, position_offset, causal=True),
        head_transform=HeadTransformConfig(head_act or hf.hidden_act, bias=True),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        lm_head_bias=True,
    )


def roberta_causal_lm_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """RobertaForCausalLM and relatives: positions from pad_token_id + 1, a GELU prediction head."""
    return causal_lm_arch_config(hf, position_offset=hf.pad_token_id + 1, head_act="gelu")


def pre_ln_causal_lm_arch_config(
    hf: PretrainedConfig, position_offset: int, head_act: str | None, embedding_norm: bool
) -> DecoderArchConfig:
    """The pre-LN relatives as causal LMs: a norm before each sublayer and after the last layer."""
    post_ln = causal_lm_arch_config(hf, position_offset, head_act)
    return dataclasses.replace(
        post_ln, pre_norm=True, norm_after_residual=False, final_norm=True, embedding_norm=embedding_norm
    )


def roberta_prelayernorm_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """RobertaPreLayerNormForCausalLM: normalized embeddings, RoBERTa's positions and head."""
    return pre_ln_causal_lm_arch_config(hf, hf.pad_token_id + 1, "gelu", embedding_norm=True)


def xlm_roberta_xl_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """XLMRobertaXLForCausalLM: embeddings not normalized, RoBERTa's positions and head."""
    return pre_ln_causal_lm_arch_config(hf, hf.pad_token_id + 1, "gelu", embedding_norm=False)


def megatron_bert_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """MegatronBertForCausalLM: embeddings not normalized, BERT's positions and head."""
    return pre_ln_causal_lm_arch_config(hf, 0, None, embedding_norm=False)


def tanh_head(hf: PretrainedConfig) -> ClassifierHeadConfig:
    """dense -> tanh -> labels: BERT's pooler + classifier, RoBERTa's classification head."""
    return ClassifierHeadConfig(hf.num_labels, dense=True, activation=classifier_activation(hf))


def _cls(hf: PretrainedConfig) -> PoolingType:
    return PoolingType.CLS


_BERT_HEAD = {"bert.pooler.dense": "head.dense", "pooler.dense": "head.dense", "classifier": "head.out_proj"}
_ROBERTA_HEAD = {"classifier.dense": "head.dense", "classifier.out_proj": "head.out_proj"}
# the pre-LN relatives' layer norms: before the attention, before the MLP
_PRELAYERNORM_RENAMES = _LAYER_RENAMES | {
    "attention.LayerNorm": "input_layernorm",
    "intermediate.LayerNorm": "post_attention_layernorm",
}
_XL_RENAMES = _LAYER_RENAMES | {
    "attention.self_attn_layer_norm": "input_layernorm",
    "LayerNorm": "post_attention_layernorm",
}
_MEGATRON_RENAMES = _LAYER_RENAMES | {"attention.ln": "input_layernorm", "ln": "post_attention_layernorm"}
# the masked-LM prediction heads: transform (dense, LayerNorm) and the decoder, its bias also stored apart
_BERT_LM_HEAD = {
    "cls.predictions.transform.dense": "model.head_transform.dense",
    "cls.predictions.transform.LayerNorm": "model.head_transform.norm",
    "cls.predictions.decoder": "lm_head",
    "cls.predictions.bias": "lm_head.bias",
}
_ROBERTA_LM_HEAD = {
    "lm_head.dense": "model.head_transform.dense",
    "lm_head.layer_norm": "model.head_transform.norm",
    "lm_head.decoder": "lm_head",
}


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


class BertLMHeadModel(DecoderForCausalLM):
    """BERT as a causal LM (HF architecture BertLMHeadModel, `is_decoder=True`)."""

    arch_config_of = staticmethod(causal_lm_arch_config)
    checkpoint_names = encoder_names("bert", _BERT_LM_HEAD)


class RobertaForCausalLM(DecoderForCausalLM):
    """RoBERTa as a causal LM (HF architecture RobertaForCausalLM, `is_decoder=True`)."""

    arch_config_of = staticmethod(roberta_causal_lm_arch_config)
    checkpoint_names = encoder_names("roberta", _ROBERTA_LM_HEAD)


class XLMRobertaForCausalLM(RobertaForCausalLM):
    """XLM-RoBERTa as a causal LM (HF architecture XLMRobertaForCausalLM)."""


class CamembertForCausalLM(RobertaForCausalLM):
    """CamemBERT (RoBERTa's layout) as a causal LM (HF architecture CamembertForCausalLM)."""


class Data2VecTextForCausalLM(RobertaForCausalLM):
    """data2vec-text (RoBERTa's layout, `data2vec_text.` names) as a causal LM (HF Data2VecTextForCausalLM)."""

    checkpoint_names = encoder_names("data2vec_text", _ROBERTA_LM_HEAD)


class RobertaPreLayerNormForCausalLM(DecoderForCausalLM):
    """RoBERTa-PreLayerNorm as a causal LM (HF architecture RobertaPreLayerNormForCausalLM)."""

    arch_config_of = staticmethod(roberta_prelayernorm_arch_config)
    checkpoint_names = encoder_names("roberta_prelayernorm", _ROBERTA_LM_HEAD, _PRELAYERNORM_RENAMES, "LayerNorm")


class XLMRobertaXLForCausalLM(DecoderForCausalLM):
    """XLM-RoBERTa-XL as a causal LM (HF architecture XLMRobertaXLForCausalLM)."""

    arch_config_of = staticmethod(xlm_roberta_xl_arch_config)
    checkpoint_names = encoder_names("roberta", _ROBERTA_LM_HEAD, _XL_RENAMES, "encoder.LayerNorm")


class MegatronBertForCausalLM(DecoderForCausalLM):
    """Megatron-BERT as a causal LM (HF architecture MegatronBertForCausalLM)."""

    arch_config_of = staticmethod(megatron_bert_arch_config)
    checkpoint_names = encoder_names("bert", _BERT_LM_HEAD, _MEGATRON_RENAMES, "encoder.ln")
