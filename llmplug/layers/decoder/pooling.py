"""The generic transformer as a pooling model: embeddings and classifiers over `DecoderModel`.

One class serves encoders (BERT, RoBERTa, ModernBERT, NomicBERT, GTE: `causal=False`) and decoders
used as embedders or classifiers (Qwen3 embeddings, `*ForSequenceClassification`, reward models).
A family subclasses `TransformerForPooling` and sets, as data:

- `arch_config_of`: its HF config -> `DecoderArchConfig` (as for the causal LM);
- `checkpoint_names`: how its checkpoint names map onto `model.*` and `head.*`;
- `head_config_of`: HF config -> `ClassifierHeadConfig`, for a classifier (None: an embedding model);
- `pooling_type_of`: HF config -> the default `PoolingType` (a sentence-transformers folder or the
  engine's `pooler.pooling_type` override it).

`as_pooling_model(cls, head)` makes the embedding or classification twin of a `DecoderForCausalLM`
family (`model.convert`), with the same adapter and names.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames, HeadLayout
from llmplug.layers.decoder.arch import DecoderArchConfig
from llmplug.layers.decoder.model import IGNORED_SUFFIXES, DecoderForCausalLM, DecoderModel, stacked_params
from llmplug.layers.pooler import ClassifierHead, ClassifierHeadConfig, Pooler, PoolingMetadata, PoolingType
from llmplug.layers.weight_utils import load_mapped_weights

__all__ = [
    "TransformerForPooling",
    "as_pooling_model",
    "classifier_activation",
    "converted_class",
    "decoder_score_head",
    "with_score_head",
]

# a checkpoint of the bare model (Qwen3-Embedding): the names of transformers' Llama without `model.`
BARE_MODEL_PREFIXES = {name: f"model.{name}" for name in ("embed_tokens", "layers", "norm")}
# a causal LM's output projection, which an embedding or classification twin knowingly drops
DROPPED_HEAD = ("lm_head.weight", "lm_head.bias")


class TransformerForPooling(nn.Module):
    """`DecoderModel` plus a `Pooler` (and a `ClassifierHead` for classifiers): a `VllmModelForPooling`."""

    arch_config_of: ClassVar[Callable[[PretrainedConfig], DecoderArchConfig]]
    checkpoint_names: ClassVar[CheckpointNames] = CheckpointNames()
    checkpoint_names_of: ClassVar[Callable[[PretrainedConfig], CheckpointNames] | None] = None  # config-dependent
    head_config_of: ClassVar[Callable[[PretrainedConfig], ClassifierHeadConfig] | None] = None
    pooling_type_of: ClassVar[Callable[[PretrainedConfig], PoolingType]] = staticmethod(lambda hf: PoolingType.LAST)
    is_pooling_model: ClassVar[bool] = True
    supports_pipeline_parallel: ClassVar[bool] = False
    supports_tensor_parallel: ClassVar[bool] = False

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        cls = type(self)
        self.arch = cls.arch_config_of(config)
        self.model = DecoderModel(self.arch, _join(prefix, "model"))
        head = cls.head_config_of(config) if cls.head_config_of is not None else None
        self.head = ClassifierHead(head, self.arch.hidden_size, _join(prefix, "head")) if head else None
        self._pooler = Pooler(self.head)
        self.default_pooling_type = cls.pooling_type_of(config)
        self.accepts_token_type_ids = self.arch.type_vocab_size > 1  # segments of a text pair (cross-encoders)

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The tasks this model pools for, its default first."""
        return self._pooler.tasks

    @property
    def type_vocab_size(self) -> int:
        """Token types (segments) the model embeds; 0: none."""
        return self.arch.type_vocab_size

    @property
    def max_positions(self) -> int | None:
        """Positions its learned position table holds (None: no table limits the length)."""
        return self.arch.max_position if self.arch.absolute_positions == "learned" else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids, positions (, token_type_ids) [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions, token_type_ids=token_type_ids)

    def pooler(self, hidden_states: torch.Tensor, pooling_metadata: PoolingMetadata) -> list[torch.Tensor]:
        """One float32 result per pooled request (see llmplug.layers.pooler)."""
        return self._pooler(hidden_states, pooling_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors through `checkpoint_names` and the stacked q/k/v (and gate/up) map."""
        arch, cls = self.arch, type(self)
        names = cls.checkpoint_names if cls.checkpoint_names_of is None else cls.checkpoint_names_of(self.config)
        weights = names.translate(
            weights, HeadLayout(arch.num_heads, arch.num_kv_heads, arch.head_dim)
        )
        return load_mapped_weights(self, weights, stacked_params(arch), (*IGNORED_SUFFIXES, *DROPPED_HEAD))


def classifier_activation(hf: PretrainedConfig) -> str:
    """The activation of a classifier's scores, as sentence-transformers and transformers define it.

    A sentence-transformers cross-encoder names it in config.json (`sentence_transformers.activation_fn`);
    else transformers' `problem_type` decides; else one label is a sigmoid score, several a softmax.
    """
    st = getattr(hf, "sentence_transformers", None) or {}
    named = str(st.get("activation_fn") or "").rsplit(".", 1)[-1].lower()
    if named:
        return {"sigmoid": "sigmoid", "identity": "identity", "softmax": "softmax", "tanh": "tanh"}.get(named, named)
    problem = getattr(hf, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification":
        return "sigmoid"
    return "sigmoid" if hf.num_labels == 1 else "softmax"


def decoder_score_head(hf: PretrainedConfig) -> ClassifierHeadConfig:
    """transformers' `*ForSequenceClassification` of a decoder: `score`, hidden -> labels, no bias."""
    return ClassifierHeadConfig(hf.num_labels, out_bias=False, activation=classifier_activation(hf))


def as_pooling_model(cls: type[DecoderForCausalLM], classify: bool) -> type[TransformerForPooling]:
    """The embedding (classify=False) or classification twin of a causal-LM family: last-token pooling, the
    family's adapter and checkpoint names, and a `score` head for classification."""
    suffix = "ForSequenceClassification" if classify else "ForEmbedding"
    name = cls.__name__.removesuffix("ForCausalLM") + suffix
    names_of = cls.checkpoint_names_of
    attributes = {
        "__doc__": f"{cls.__name__} as {'a classifier' if classify else 'an embedding model'} (model.convert).",
        "__module__": cls.__module__,
        "arch_config_of": staticmethod(cls.arch_config_of),
        "checkpoint_names": _pooling_names(cls.checkpoint_names, classify),
        "checkpoint_names_of": None if names_of is None else staticmethod(
            lambda hf: _pooling_names(names_of(hf), classify)
        ),
        "head_config_of": staticmethod(decoder_score_head) if classify else None,
    }
    return type(name, (TransformerForPooling,), attributes)


def _pooling_names(names: CheckpointNames, classify: bool) -> CheckpointNames:
    """A causal LM's names for its pooling twin: bare-model checkpoints accepted, plus the `score` head."""
    if not names.prefixes:  # transformers' Llama names: embedders are often saved as the bare model
        names = dataclasses.replace(names, prefixes=BARE_MODEL_PREFIXES)
    return with_score_head(names) if classify else names


def converted_class(cls: type, convert: str) -> type:
    """The class to build for `model.convert`: `cls` itself ("none"), or its embedding / classification twin."""
    if convert == "none":
        return cls
    twin = getattr(cls, "pooling_twin", None)  # a model with its own pooling form (the transformers backend)
    if twin is not None:
        return twin(convert)
    if not (isinstance(cls, type) and issubclass(cls, DecoderForCausalLM)):
        raise ValueError(f"model.convert={convert!r} needs a generic-decoder causal LM; {cls.__name__} is not one")
    return as_pooling_model(cls, classify=convert == "classify")


def with_score_head(names: CheckpointNames) -> CheckpointNames:
    """A family's names plus transformers' `score` projection of a decoder classifier, as `head.out_proj`."""
    return dataclasses.replace(names, prefixes={**names.prefixes, "score": "head.out_proj"})


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
