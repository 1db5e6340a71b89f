"""Pooling models through the transformers backend that run whole prompts on transformers' own attention: any
encoder transformers has (the bare model of the folder's type, or the sequence classifier its `architectures`
names), and bare models whose attention paged attention cannot run.

A pooling engine runs each prompt whole in one step, without a KV cache; these models run each prompt of the
step alone, as transformers runs one sentence (its own position ids, token types and attention), so they pool as
transformers does. A prompt starts where the positions restart at 0.
"""

from __future__ import annotations

import copy
import inspect
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.decoder.pooling import classifier_activation
from llmplug.layers.pooler import Pooler, PoolingMetadata, PoolingType, score_activation
from llmplug.plugins.models.transformers_backend.base import TransformersModel
from llmplug.plugins.models.transformers_backend.support import (
    base_model_class,
    is_encoder,
    sequence_classification_class,
)

__all__ = ["TransformersEncoderForEmbedding", "TransformersEncoderForSequenceClassification", "prompt_spans"]

# the parts a sequence classifier puts after its bare model, applied to the prompt's [1, tokens, hidden] in
# order (dropout, parameterless, is skipped): ELECTRA's and RoBERTa's head is one `classifier`; DeBERTa's a
# context `pooler` then a linear `classifier`
HEAD_LAYOUTS = (("classifier",), ("pooler", "classifier"))


def prompt_spans(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each prompt of a pooling step's flattened tokens: each starts at position 0 and runs
    0, 1, 2, ... (pooling prompts are never chunked nor cached); ValueError otherwise."""
    values = positions.tolist()  # one device read for the step
    starts = [i for i, position in enumerate(values) if position == 0]
    if not starts or starts[0] != 0:
        raise ValueError("the transformers backend's encoders run whole prompts: a step's tokens must start a prompt")
    spans = list(zip(starts, [*starts[1:], len(values)]))
    for start, end in spans:
        if values[end - 1] != end - start - 1:
            raise ValueError(f"tokens {start}..{end} of the step are not one whole prompt (positions "
                             f"{values[start:end][:8]}...)")
    return spans


class _WholePromptEncoder(TransformersModel):
    """A transformers model run prompt by prompt on its own attention; forward gives its bare model's rows."""

    is_pooling_model: ClassVar[bool] = True
    paged: ClassVar[bool] = False
    supports_tensor_parallel: ClassVar[bool] = False  # transformers' attention runs on one worker

    @staticmethod
    def refusal(hf_class: type, config: PretrainedConfig) -> str | None:
        return None  # transformers' own attention runs whatever the class is

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        base = self.model.base_model
        self.type_vocab_size = int(getattr(config, "type_vocab_size", 0) or 0)
        self.accepts_token_type_ids = self.type_vocab_size > 0 and "token_type_ids" in _arguments(base.forward)
        # an encoder's first token stands for the prompt; a decoder's last (one paged attention cannot run)
        self.default_pooling_type = PoolingType.CLS if is_encoder(config) else PoolingType.LAST

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] (the step's whole prompts) -> the bare model's last hidden states [T, hidden]."""
        rows = []
        for start, end in prompt_spans(positions):
            types = {} if token_type_ids is None else {"token_type_ids": token_type_ids[None, start:end]}
            rows.append(self.model.base_model(input_ids=input_ids[None, start:end], **types)[0][0])
        return torch.cat(rows)  # [T, hidden]


class TransformersEncoderForEmbedding(_WholePromptEncoder):
    """A transformers bare model (an encoder's, or a decoder's that paged attention cannot run) as an embedding
    model; a sentence-transformers folder's pooling and normalisation apply as for the native encoders
    (docs/pooling.md), else CLS pooling for an encoder, LAST for a decoder."""

    find_hf_class = staticmethod(base_model_class)
    hf_class_kind = "bare model"

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        self._pooler = Pooler()

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The tasks this model pools for, its default first."""
        return self._pooler.tasks

    def pooler(self, hidden_states: torch.Tensor, pooling_metadata: PoolingMetadata) -> list[torch.Tensor]:
        """One float32 result per pooled request (see llmplug.layers.pooler)."""
        return self._pooler(hidden_states, pooling_metadata)


class TransformersEncoderForSequenceClassification(_WholePromptEncoder):
    """A transformers `*ForSequenceClassification` (an encoder's): its bare model, then its own head on each
    prompt's rows (`HEAD_LAYOUTS`), then the classifier activation of its config."""

    find_hf_class = staticmethod(sequence_classification_class)
    hf_class_kind = "sequence classifier"

    @staticmethod
    def refusal(hf_class: type, config: PretrainedConfig) -> str | None:
        """Why the class's head cannot run on a prompt's rows (built on the meta device to see it), or None."""
        with torch.device("meta"):
            model = hf_class._from_config(copy.deepcopy(config))
        try:
            _head_parts(model)
        except ValueError as error:
            return str(error)
        return None

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        self.head = _head_parts(self.model)
        self.num_labels = int(config.num_labels)
        self.activation = score_activation(classifier_activation(config))

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """classify, and score for a one-label model (a cross-encoder)."""
        return ("classify", "score") if self.num_labels == 1 else ("classify",)

    def pooler(self, hidden_states: torch.Tensor, pooling_metadata: PoolingMetadata) -> list[torch.Tensor]:
        """One float32 [num_labels] per request: the head on its prompt's rows, activated where it asks."""
        results = []
        for start, length, params in zip(pooling_metadata.starts, pooling_metadata.lens, pooling_metadata.params):
            if params.task not in self.pooling_tasks:
                raise ValueError(f"this model pools for {', '.join(self.pooling_tasks)}, not {params.task!r}")
            rows = hidden_states[None, start : start + length]  # [1, tokens, hidden]
            for part in self.head:
                rows = part(rows)
            logits = rows[0].float()  # [num_labels]
            results.append(logits if params.use_activation is False else self.activation(logits))
        return results


def _head_parts(model: nn.Module) -> list[nn.Module]:
    """The classifier's head after its bare model, in order; ValueError naming the class when its layout is not
    one of HEAD_LAYOUTS or it does not give one row of labels per prompt."""
    names = tuple(name for name, child in model.named_children()
                  if name != model.base_model_prefix and next(child.parameters(), None) is not None)
    name = type(model).__name__
    if names not in HEAD_LAYOUTS:
        raise ValueError(f"{name}'s head is {list(names)}, not one of the layouts the transformers backend applies "
                         f"on a prompt's rows: {[list(layout) for layout in HEAD_LAYOUTS]}")
    parts = [getattr(model, part) for part in names]
    probe = torch.zeros(1, 3, model.config.hidden_size, device="meta")
    for part in parts:  # copies on the meta device: the shapes, without computing on the weights
        probe = copy.deepcopy(part).to("meta")(probe)
    if tuple(probe.shape) != (1, model.config.num_labels):
        raise ValueError(f"{name}'s head gives {tuple(probe.shape)} for one prompt of 3 tokens, not one row of "
                         f"{model.config.num_labels} labels: it does not pool the prompt itself")
    return parts


def _arguments(function: object) -> set[str]:
    return set(inspect.signature(function).parameters)
