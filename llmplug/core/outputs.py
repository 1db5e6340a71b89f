"""What the engine returns: RequestOutput, CompletionOutput; PoolingRequestOutput and its embedding,
classification and scoring views; BeamSearchOutput (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token, its rank in the distribution and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the sampled token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life, as the engine measured them.

    Queue time is first_scheduled - arrival, prefill first_token - first_scheduled, decode last_token -
    first_token. `inter_token_latencies` holds the time between consecutive steps that gave the request
    tokens; it is complete in the request's finished output (earlier outputs may hold a shorter list).
    """

    arrival_time: float  # the engine received it
    first_scheduled_time: float | None = None  # it first got a place in the running batch
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, one per step after the first token
    engine_index: int = 0  # the data-parallel replica that ran it (vLLM's `engine` metrics label)


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    error: str | None = None  # with finish_reason "abort": what failed inside the engine for this completion

    def finished(self) -> bool:
        """True once a finish reason is set."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: prompt, completions so far, whether it finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0


@dataclass
class PoolingOutput:
    """A pooled result: a torch.Tensor ([D] per request, or [num_tokens, D] for per-token tasks)."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """The pooled result of one request (`LLM.encode`); the task-specific outputs below derive from it."""

    request_id: str
    outputs: Any  # PoolingOutput here; EmbeddingOutput, ClassificationOutput or ScoringOutput in subclasses
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = field(default=None)
    error: str | None = None  # why a failure inside a step ended it (then `outputs` is None)

    @classmethod
    def from_base(cls, base: "PoolingRequestOutput") -> "PoolingRequestOutput":
        """This task's view of a plain pooling output."""
        return cls(base.request_id, cls.output_of(base.outputs.data), base.prompt_token_ids, base.finished,
                   base.metrics)

    @staticmethod
    def output_of(data: Any) -> Any:
        return PoolingOutput(data)


@dataclass
class EmbeddingOutput:
    """One embedding vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """Its number of features."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """`LLM.embed`'s result for one prompt."""

    @staticmethod
    def output_of(data: Any) -> EmbeddingOutput:
        return EmbeddingOutput(data.tolist())


@dataclass
class ClassificationOutput:
    """Class probabilities (or raw logits with use_activation=False)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """How many classes."""
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """`LLM.classify`'s result for one prompt."""

    @staticmethod
    def output_of(data: Any) -> ClassificationOutput:
        return ClassificationOutput(data.tolist())


@dataclass
class ScoringOutput:
    """The relevance score of a text pair."""

    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    """`LLM.score`'s result for one pair: a cross-encoder's score, or the cosine similarity of two embeddings."""

    @staticmethod
    def output_of(data: Any) -> ScoringOutput:
        return ScoringOutput(float(data.reshape(-1)[0]))


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's and the generated tokens, the generated tokens' logprobs and their sum."""

    tokens: list[int]  # prompt + generated, as vLLM's
    logprobs: list[PositionLogprobs]  # one per generated token
    cum_logprob: float = 0.0
    text: str | None = None  # the decoded prompt and generated tokens
    finish_reason: str | None = None  # "stop" (an end token) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
