"""Pooling: from one step's hidden states to each prompt's embedding, class scores or per-token rows.

The model runner hands a pooling model the step's hidden states and a `PoolingMetadata`: where each
pooled prompt lies in them (always whole: pooling prompts are never chunked), each request's
`PoolingParams` with its task and defaults resolved, and the engine's pooling type. The model's
`Pooler` runs, per task:

    embed, score (bi-encoder)  : CLS / LAST / MEAN row -> first `dimensions` features -> L2 normalize
    token_embed                : every row             -> first `dimensions` features -> L2 normalize
    classify, score            : CLS / LAST / MEAN row -> classifier head -> activation
    token_classify             : every row             -> classifier head -> activation

`ClassifierHead` is the head of `*ForSequenceClassification` models as data: an optional dense
layer with its activation and norm (BERT's pooler, RoBERTa's and ModernBERT's heads), then the
projection to the labels (a decoder's `score`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.core.params import PoolingParams
from llmplug.layers.activation import activation_fn
from llmplug.layers.layernorm import NormConfig, make_norm
from llmplug.layers.linear import ReplicatedLinear

__all__ = [
    "CLASSIFY_TASKS",
    "EMBED_TASKS",
    "ClassifierHead",
    "ClassifierHeadConfig",
    "Pooler",
    "PoolingMetadata",
    "PoolingType",
    "score_activation",
]

EMBED_TASKS = frozenset({"embed", "token_embed"})
CLASSIFY_TASKS = frozenset({"classify", "score", "token_classify"})
TOKEN_TASKS = frozenset({"token_embed", "token_classify"})


class PoolingType(str, enum.Enum):
    """Which hidden states stand for a whole prompt."""

    LAST = "LAST"  # the last token's (decoders)
    CLS = "CLS"  # the first token's (BERT's [CLS])
    MEAN = "MEAN"  # the mean over the prompt's tokens (sentence-transformers' usual pooling)
    ALL = "ALL"  # every token's, one row each (the per-token tasks use it whatever the type)


@dataclass(frozen=True, slots=True)
class PoolingMetadata:
    """The requests of one step that pool: their rows in the hidden states, params and the pooling type."""

    starts: list[int]  # row of each request's first prompt token in the step's hidden states
    lens: list[int]  # tokens of each request's prompt (all in this step)
    params: list[PoolingParams]  # task set, normalize and use_activation resolved by the engine
    pooling_type: PoolingType


# classifier activations by name (sentence-transformers' and transformers' problem types map onto them)
SCORE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
    "tanh": torch.tanh,
}


def score_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The classifier activation called `name`; ValueError listing the known ones otherwise."""
    if name not in SCORE_ACTIVATIONS:
        raise ValueError(f"classifier activation {name!r} is not one of {sorted(SCORE_ACTIVATIONS)}")
    return SCORE_ACTIVATIONS[name]


@dataclass(frozen=True, slots=True)
class ClassifierHeadConfig:
    """A classification head: [dense -> activation -> norm] -> projection to the labels -> score activation."""

    num_labels: int
    dense: bool = False  # a hidden x hidden layer first (BERT's pooler, RoBERTa's and ModernBERT's heads)
    dense_bias: bool = True
    dense_activation: str = "tanh"
    norm: NormConfig | None = None  # after the dense activation (ModernBERT)
    out_bias: bool = True
    activation: str = "softmax"  # of the scores when the request uses it (SCORE_ACTIVATIONS)


class ClassifierHead(nn.Module):
    """hidden [N, H] -> label logits [N, num_labels] (parameters `dense`, `norm`, `out_proj`)."""

    def __init__(self, config: ClassifierHeadConfig, hidden_size: int, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        dense = config.dense
        self.dense = ReplicatedLinear(hidden_size, hidden_size, config.dense_bias, f"{prefix}.dense") if dense else None
        self.act = activation_fn(config.dense_activation) if config.dense else None
        self.norm = make_norm(config.norm, hidden_size) if config.norm is not None else None
        self.out_proj = ReplicatedLinear(hidden_size, config.num_labels, config.out_bias, f"{prefix}.out_proj")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, num_labels] in the model's dtype."""
        if self.dense is not None:
            hidden = self.act(self.dense(hidden))
        if self.norm is not None:
            hidden = self.norm(hidden)
        return self.out_proj(hidden)


class Pooler:
    """Pooling, then the task's head; a model holds one (its head stays the model's own module) and calls
    it from its `pooler` method.

    Without a `classifier` the model embeds (embed, token_embed); with one it classifies (classify,
    token_classify, and score when it has one label). A per-token task needs a classifier without a
    dense layer (a decoder's `score`): the dense heads were trained on one pooled row.
    """

    def __init__(self, classifier: ClassifierHead | None = None) -> None:
        self.classifier = classifier
        self.activation = score_activation(classifier.config.activation) if classifier is not None else None

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks this pooler serves, the default first."""
        if self.classifier is None:
            return ("embed", "token_embed")
        head = self.classifier.config
        tasks = ["classify", *(["score"] if head.num_labels == 1 else [])]
        return (*tasks, *([] if head.dense else ["token_classify"]))

    def __call__(self, hidden_states: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        """One float32 result per request of `metadata`: [D] (or [prompt tokens, D] for per-token tasks)."""
        results: list[torch.Tensor | None] = [None] * len(metadata.params)
        by_task: dict[str, list[int]] = {}
        for i, params in enumerate(metadata.params):
            by_task.setdefault(params.task, []).append(i)
        for task, indexes in by_task.items():
            if task not in self.tasks:
                raise ValueError(f"this model pools for {', '.join(self.tasks)}, not {task!r}")
            outputs = self._token_task(hidden_states, metadata, indexes) if task in TOKEN_TASKS else \
                self._sequence_task(hidden_states, metadata, indexes)
            for i, out in zip(indexes, outputs):
                results[i] = out
        return results

    def _sequence_task(self, hidden: torch.Tensor, metadata: PoolingMetadata, indexes: list[int]) -> list[torch.Tensor]:
        rows = pool_rows(hidden, [metadata.starts[i] for i in indexes], [metadata.lens[i] for i in indexes],
                         metadata.pooling_type)  # [n, H]
        params = [metadata.params[i] for i in indexes]
        if self.classifier is None:
            return list(_embed(rows.float(), params))
        return list(self._classify(rows, params))

    def _token_task(self, hidden: torch.Tensor, metadata: PoolingMetadata, indexes: list[int]) -> list[torch.Tensor]:
        outputs = []
        for i in indexes:
            start, length, params = metadata.starts[i], metadata.lens[i], metadata.params[i]
            rows = hidden[start : start + length]  # [L, H]
            if self.classifier is None:
                outputs.append(_embed(rows.float(), [params] * length))
            else:
                outputs.append(self._classify(rows, [params] * length))
        return outputs

    def _classify(self, rows: torch.Tensor, params: list[PoolingParams]) -> torch.Tensor:
        """[n, H] -> float32 scores [n, num_labels], activated for the rows whose request wants it."""
        logits = self.classifier(rows.to(self.classifier.out_proj.weight.dtype)).float()
        use = torch.tensor([p.use_activation is not False for p in params], device=logits.device)
        return torch.where(use[:, None], self.activation(logits), logits) if bool(use.any()) else logits


def pool_rows(hidden: torch.Tensor, starts: list[int], lens: list[int], pooling_type: PoolingType) -> torch.Tensor:
    """The row standing for each prompt: [n, H] (MEAN in float32, the others in the hidden states' dtype)."""
    device = hidden.device
    if pooling_type == PoolingType.CLS:
        return hidden.index_select(0, torch.tensor(starts, device=device))
    if pooling_type == PoolingType.LAST:
        return hidden.index_select(0, torch.tensor([s + n - 1 for s, n in zip(starts, lens)], device=device))
    if pooling_type == PoolingType.MEAN:
        # one mean per contiguous prompt: index_add_ over a segment index is ~100x slower on CPU
        return torch.stack([hidden[s : s + n].mean(0, dtype=torch.float32) for s, n in zip(starts, lens)])
    raise ValueError(f"pooling type {pooling_type.value} gives one row per token: use a per-token task")


def _embed(rows: torch.Tensor, params: list[PoolingParams]) -> torch.Tensor | list[torch.Tensor]:
    """Float32 rows [n, H] -> their first `dimensions` features, L2-normalized where asked ([n, D] when
    every request asks the same, else a list)."""
    first = params[0]
    if all(p.dimensions == first.dimensions and p.normalize == first.normalize for p in params):
        out = rows[:, : first.dimensions] if first.dimensions else rows
        return F.normalize(out, dim=-1) if first.normalize else out
    outputs = []
    for row, p in zip(rows, params):
        out = row[: p.dimensions] if p.dimensions else row
        outputs.append(F.normalize(out, dim=-1) if p.normalize else out)
    return outputs
