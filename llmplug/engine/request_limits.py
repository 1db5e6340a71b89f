"""The checks of a request's SamplingParams against the model and the engine's limits, before it is queued.

SamplingParams checks what needs no model when it is built; what depends on the model (token ids
within the vocabulary, room in the context) and on the engine's configured limits (`decoding.max_*`)
is checked here. A request that passes cannot fail inside a step because of its parameters: every
error names the field and value and is an InvalidRequestError (a 400 through the server).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from llmplug.core.config import DecodingConfig
from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request is checked against: the model's vocabulary and context, and the configured caps."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    max_n: int
    max_stop_strings: int
    max_stop_string_length: int
    max_allowed_token_ids: int
    max_bad_words: int
    max_bad_word_length: int

    @classmethod
    def of(cls, vocab_size: int, max_model_len: int, decoding: DecodingConfig) -> "RequestLimits":
        """The limits of a model with the engine's `decoding` config."""
        return cls(
            vocab_size, max_model_len, decoding.max_logprobs, decoding.max_n,
            decoding.max_stop_strings, decoding.max_stop_string_length,
            decoding.max_allowed_token_ids, decoding.max_bad_words, decoding.max_bad_word_length,
        )


def check_list_sizes(params: SamplingParams, limits: RequestLimits) -> None:
    """InvalidRequestError when a list of `params` that costs work per item is past its cap (checked before
    that work: bad words are tokenized, allowed token ids turned into a mask)."""
    allowed = params.allowed_token_ids or ()
    if len(allowed) > limits.max_allowed_token_ids:
        _fail("allowed_token_ids", f"<{len(allowed)} ids>", f"has more than the engine's limit of "
              f"{limits.max_allowed_token_ids} ids (decoding.max_allowed_token_ids)")
    words = params.bad_words or ()
    if len(words) > limits.max_bad_words:
        _fail("bad_words", f"<{len(words)} words>",
              f"has more than the engine's limit of {limits.max_bad_words} words (decoding.max_bad_words)")
    too_long = next((w for w in words if len(w) > limits.max_bad_word_length), None)
    if too_long is not None:
        _fail("bad_words", f"{too_long[:20]!r}... ({len(too_long)} characters)",
              f"holds a word longer than the engine's limit of {limits.max_bad_word_length} characters "
              "(decoding.max_bad_word_length)")


def check_params(params: SamplingParams, num_prompt_tokens: int, limits: RequestLimits) -> None:
    """InvalidRequestError naming the first field of `params` that this model or the limits cannot serve.

    `params.max_tokens` must be resolved (not None) already.
    """
    _check_counts(params, num_prompt_tokens, limits)
    _check_stop_strings(params.stop, limits)
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids)):
        _check_token_ids(name, ids or (), limits.vocab_size)
    bad = [t for t in params.logit_bias or () if not 0 <= t < limits.vocab_size]
    if bad:
        _fail("logit_bias", params.logit_bias, f"has keys {bad[:5]} outside the vocabulary [0, {limits.vocab_size})")


def _check_counts(params: SamplingParams, num_prompt_tokens: int, limits: RequestLimits) -> None:
    room = limits.max_model_len - num_prompt_tokens
    if params.max_tokens > room:
        _fail("max_tokens", params.max_tokens,
              f"does not fit the context: the prompt has {num_prompt_tokens} tokens and max_model_len is "
              f"{limits.max_model_len}, so at most {room} tokens can be generated")
    if params.min_tokens > params.max_tokens:
        _fail("min_tokens", params.min_tokens, f"exceeds max_tokens={params.max_tokens}")
    if params.n > limits.max_n:
        _fail("n", params.n, f"exceeds the engine's limit of {limits.max_n} (decoding.max_n)")
    top = min(limits.max_logprobs, limits.vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > top:
            _fail(name, value, f"exceeds the engine's limit of {top} (decoding.max_logprobs="
                               f"{limits.max_logprobs}, vocabulary of {limits.vocab_size})")


def _check_stop_strings(stop: list[str], limits: RequestLimits) -> None:
    if len(stop) > limits.max_stop_strings:
        _fail("stop", f"<{len(stop)} strings>",
              f"has more than the engine's limit of {limits.max_stop_strings} strings (decoding.max_stop_strings)")
    too_long = next((s for s in stop if len(s) > limits.max_stop_string_length), None)
    if too_long is not None:
        _fail("stop", f"{too_long[:20]!r}... ({len(too_long)} characters)",
              f"holds a string longer than the engine's limit of {limits.max_stop_string_length} characters "
              "(decoding.max_stop_string_length)")


def _check_token_ids(name: str, token_ids: Iterable[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        _fail(name, bad[:5], f"holds token ids outside the vocabulary [0, {vocab_size})")


def _fail(name: str, value: object, why: str) -> None:
    raise InvalidRequestError(f"SamplingParams.{name}={value!s} {why}", param=name)
