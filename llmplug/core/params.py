"""Per-request parameters: SamplingParams, GuidedDecodingParams, PoolingParams."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from llmplug.core.errors import InvalidRequestError


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries while it streams."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_VALUE_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")  # the kinds that carry a value


@dataclass
class GuidedDecodingParams:
    """A constraint on the generated text; exactly one of json, json_object, regex, choice, grammar,
    structural_tag is set.

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: the text must match it
    in full; choice: the text is one of these strings; grammar: a context-free grammar in the syntax of
    the backend (Lark for llguidance; GBNF-style EBNF, `root ::= ...`, for xgrammar and llguidance);
    structural_tag: free text in which tagged regions follow their schemas (xgrammar's structural tag,
    dict or JSON text).

    start_after_token_ids: the grammar applies only once the output has produced this token sequence
    (the end of a model's reasoning, such as `</think>`); the tokens before it are sampled freely.
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None
    backend: str | None = None  # None: the engine's decoding.guided_backend
    whitespace_flexible: bool | None = None  # None: the engine's decoding.compact_json decides
    start_after_token_ids: tuple[int, ...] = ()  # empty: the grammar applies from the first token

    def __post_init__(self) -> None:
        kinds = [k for k in _VALUE_KINDS if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError(
                f"guided_decoding needs exactly one of {', '.join(GUIDED_KINDS)}; got {kinds or 'none'}"
            )
        if isinstance(self.json, str):
            self.json = _parse_json(self.json, "json")
        if isinstance(self.structural_tag, str):
            self.structural_tag = _parse_json(self.structural_tag, "structural_tag")
        self.start_after_token_ids = tuple(self.start_after_token_ids)
        self._validate()

    def _validate(self) -> None:
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError(f"guided_decoding.json must be a JSON schema object, got {type(self.json).__name__}")
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise InvalidRequestError(
                f"guided_decoding.structural_tag must be a JSON object, got {type(self.structural_tag).__name__}"
            )
        if not all(isinstance(t, int) and t >= 0 for t in self.start_after_token_ids):
            raise InvalidRequestError(
                f"guided_decoding.start_after_token_ids must be token ids, got {self.start_after_token_ids!r}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"guided_decoding.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError(
                    f"guided_decoding.choice must be a non-empty list of non-empty strings, got {self.choice!r}"
                )

    @property
    def kind(self) -> str:
        """The name of the constraint kind that is set."""
        if self.json_object:
            return "json_object"
        return next(k for k in _VALUE_KINDS if getattr(self, k) is not None)

    @property
    def schema(self) -> dict | bool:
        """The JSON schema of a json or json_object constraint."""
        return {"type": "object"} if self.json_object else self.json

    @property
    def cache_key(self) -> tuple:
        """What identifies the compiled grammar of this constraint (besides the backend)."""
        import json

        value = None if self.json_object else getattr(self, self.kind)
        return self.kind, json.dumps(value, sort_keys=True), self.whitespace_flexible


def _parse_json(text: str, name: str) -> dict | bool:
    """A JSON value (schema, structural tag) given as JSON text."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"guided_decoding.{name} is not valid JSON: {exc}") from None


# Found by fuzzing the server: a penalty of 5e-324 is "positive and finite" yet divides logits into inf.
REPETITION_PENALTY_RANGE = (0.01, 100.0)

@dataclass
class SamplingParams:
    """How to sample the completion of one prompt (names and defaults follow vLLM)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None or 0: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # never generate these words (token sequences, as vLLM)
    allowed_token_ids: list[int] | None = None  # sample only among these tokens
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = 16  # None: up to the model's context length
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logits_processors: list[Callable[..., Any]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    guided_decoding: GuidedDecodingParams | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)
    # the token sequences of bad_words as the engine's tokenizer spells them: set by the engine when a request is added
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = None
        self._validate()

    def _validate(self) -> None:
        """Checks that need no model; the engine checks the rest (vocabulary, context, limits) when it adds the request."""
        self._check_types()
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k is None or self.top_k >= 1 or self.top_k == -1, "top_k", "must be None, -1, 0 or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
             "repetition_penalty", "must be in [0.01, 100] (1: none); beyond, the logits it divides or multiplies "
             "leave float32's range and no token can be sampled"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must not exceed max_tokens"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be non-negative"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", "must be non-negative"),
            (all(s for s in self.stop), "stop", "must not contain an empty string (it would match at once)"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
             "must not be empty (no token could be sampled)"),
            (all(w.strip() for w in self.bad_words or ()), "bad_words", "must not contain an empty word"),
            (all(math.isfinite(v) for v in (self.logit_bias or {}).values()), "logit_bias", "values must be finite"),
        ]
        checks.append((
            all(callable(p) for p in self.logits_processors or ()), "logits_processors",
            "must be a list of callables (output_token_ids, logits) -> logits",
        ))
        # a grammar decides where the output may end; forbidding the end token there would leave no token
        checks.append((self.guided_decoding is None or self.min_tokens == 0, "min_tokens",
                       "must be 0 with guided_decoding (the grammar decides where the output ends)"))
        for ok, name, why in checks:
            if not ok:
                raise InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r} {why}", param=name)
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            self.top_k = None

    def _check_types(self) -> None:
        """Each field has its type (a wrong one would fail inside an engine step, not here)."""
        ints = ("n", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed", "top_k")
        floats = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
        lists = {"stop": str, "stop_token_ids": int, "bad_words": str, "allowed_token_ids": int}
        for name in ints:
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise InvalidRequestError(f"SamplingParams.{name}={value!r} must be an integer", param=name)
        for name in floats:
            value = getattr(self, name)
            if _is_kind(value, float) and not math.isnan(value):
                continue
            raise InvalidRequestError(f"SamplingParams.{name}={value!r} must be a number", param=name)
        if not math.isfinite(self.temperature):
            raise InvalidRequestError(
                f"SamplingParams.temperature={self.temperature!r} must be finite", param="temperature"
            )
        for name, kind in lists.items():
            value = getattr(self, name)
            if value is not None and not (isinstance(value, list) and all(_is_kind(v, kind) for v in value)):
                raise InvalidRequestError(
                    f"SamplingParams.{name}={value!r} must be a list of {kind.__name__}", param=name
                )
        bias = self.logit_bias
        if bias is not None and not (
            isinstance(bias, dict) and all(_is_int(k) and _is_kind(v, float) for k, v in bias.items())
        ):
            raise InvalidRequestError(
                f"SamplingParams.logit_bias={bias!r} must map token ids (int) to numbers", param="logit_bias"
            )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature < 1e-5

    def clone(self) -> "SamplingParams":
        """A shallow copy that does not share the mutable lists."""
        import copy

        new = copy.copy(self)
        new.stop, new.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        return new


def _is_int(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_kind(value: Any, kind: type) -> bool:
    """`value` is of `kind`; for float, any int or float (not a bool)."""
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return _is_int(value) if kind is int else isinstance(value, kind)


POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")


@dataclass
class PoolingParams:
    """How to pool one prompt's hidden states into a result (names follow vLLM).

    task: what the result is — "embed" (one vector), "classify" (class probabilities), "score" (a
    cross-encoder's relevance of a text pair), "token_embed" / "token_classify" (one row per token).
    `LLM.embed`, `LLM.classify`, `LLM.score` and `LLM.encode` set it; None: the model's first task.
    dimensions: keep the first `dimensions` features of an embedding (Matryoshka models), then normalize.
    normalize: L2-normalize embeddings; None: the model's default (its sentence-transformers folder, else True).
    use_activation: apply the classifier's activation (softmax, or sigmoid for one label); None: True.
    """

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidRequestError(
                f"PoolingParams.task={self.task!r} is not one of {', '.join(POOLING_TASKS)}", param="task"
            )
        if self.dimensions is not None and not (_is_int(self.dimensions) and self.dimensions >= 1):
            raise InvalidRequestError(
                f"PoolingParams.dimensions={self.dimensions!r} must be a positive integer", param="dimensions"
            )
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"PoolingParams.{name}={getattr(self, name)!r} must be a bool", param=name)

    def with_task(self, task: str) -> "PoolingParams":
        """A copy for `task` (the engine fills defaults into copies, never into the caller's object)."""
        import dataclasses

        return dataclasses.replace(self, task=task)
