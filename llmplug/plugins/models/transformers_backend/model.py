"""The transformers backend's text models and the choice of backend class.

`TransformersForCausalLM` generates; `TransformersForEmbedding` is its pooling twin (the bare model, then
llmplug's `Pooler`). `backend_class(config)` says which backend class runs a config, or why none can: these two,
the multimodal model (multimodal.py) or the whole-prompt encoders (encoder.py).
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.pooler import Pooler, PoolingMetadata, PoolingType
from llmplug.plugins.models.transformers_backend.base import TransformersModel, check_plain_head
from llmplug.plugins.models.transformers_backend.encoder import (
    TransformersEncoderForEmbedding,
    TransformersEncoderForSequenceClassification,
)
from llmplug.plugins.models.transformers_backend.multimodal import TransformersForMultimodalLM
from llmplug.plugins.models.transformers_backend.support import (
    base_model_class,
    causal_lm_architectures,
    causal_lm_class,
    image_text_to_text_class,
    is_encoder,
    sequence_classification_class,
    unsupported_reason,
)

__all__ = ["TransformersForCausalLM", "TransformersForEmbedding", "backend_class"]


def backend_class(config: PretrainedConfig) -> type[nn.Module]:
    """The backend class that runs `config` (its first architecture, one of transformers' classes for the config's
    model type): its causal LM, its image-text-to-text model, its sequence classifier or its bare model (an
    encoder's, or one that paged attention cannot run, whole prompt by whole prompt); ValueError naming the
    architecture otherwise."""
    architecture = (getattr(config, "architectures", None) or ["<none>"])[0]
    for backend, hf_class in _candidates(config):
        if hf_class is not None and hf_class.__name__ == architecture:
            reason = backend.refusal(hf_class, config)
            if reason is not None:
                raise ValueError(f"architecture {architecture!r} cannot run on the transformers backend: {reason}")
            return backend
    raise ValueError(
        f"architecture {architecture!r} is not registered natively (see `llmplug models`) and transformers has no "
        f"causal-LM, image-text-to-text, sequence-classification or bare-model class of that name for model type "
        f"{config.model_type!r}"
    )


def _candidates(config: PretrainedConfig) -> list[tuple[type[TransformersModel], type | None]]:
    """(backend class, the transformers class it would build) for each kind of class the config's type has."""
    bare = base_model_class(config)
    whole = is_encoder(config) or (bare is not None and unsupported_reason(bare, config) is not None)
    return [
        # first: a class in both mappings (Gemma 3's, Fuyu's) takes images
        (TransformersForMultimodalLM, image_text_to_text_class(config)),
        (TransformersForCausalLM, causal_lm_class(config)),
        (TransformersEncoderForSequenceClassification, sequence_classification_class(config)),
        (TransformersEncoderForEmbedding if whole else TransformersForEmbedding, bare),
    ]


class TransformersForCausalLM(TransformersModel):
    """Any transformers causal LM whose class supports the attention interface, on llmplug's paged attention."""

    find_hf_class = staticmethod(causal_lm_class)
    hf_class_kind = "causal LM"

    @staticmethod
    def architectures(model_types: Iterable[str] | None = None) -> dict[str, tuple[str | None, bool]]:
        """transformers' causal-LM class names (of `model_types`, default all) -> (why the backend cannot run them
        or None, whether they have a tensor-parallel plan); see `causal_lm_architectures`. Imports each class."""
        return causal_lm_architectures(model_types)

    @staticmethod
    def pooling_twin(convert: str) -> type[nn.Module]:
        """The class `model.convert` runs this architecture as (embed: TransformersForEmbedding)."""
        if convert != "embed":
            raise ValueError(f"model.convert={convert!r}: the transformers backend converts causal LMs to 'embed' only")
        return TransformersForEmbedding

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        check_plain_head(self.model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return self._hidden_states(input_ids, positions, self.model.base_model)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]: the model's lm_head, then its final soft-cap if it has one."""
        return self._logits(hidden_states)


class TransformersForEmbedding(TransformersModel):
    """A transformers bare decoder (or a causal LM's, with model.convert=embed) as an embedding model, on paged
    attention."""

    is_pooling_model: ClassVar[bool] = True

    find_hf_class = staticmethod(base_model_class)
    hf_class_kind = "bare model"

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        causal = all(layer.causal for layer in self.attention)
        self.default_pooling_type = PoolingType.LAST if causal else PoolingType.CLS
        self._pooler = Pooler()

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The tasks this model pools for, its default first."""
        return self._pooler.tasks

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return self._hidden_states(input_ids, positions, self.model)

    def pooler(self, hidden_states: torch.Tensor, pooling_metadata: PoolingMetadata) -> list[torch.Tensor]:
        """One float32 result per pooled request (see llmplug.layers.pooler)."""
        return self._pooler(hidden_states, pooling_metadata)

    def _kept(self, name: str) -> bool:
        """A causal LM's checkpoint: its output head is dropped (transformers strips the base model prefix)."""
        return not name.startswith("lm_head.")
