"""Whisper's generation rules as per-request logits processors, as transformers' `WhisperForConditionalGeneration.
generate` applies them: `suppress_tokens` never sampled, `begin_suppress_tokens` not as the first token, and with
timestamps the timestamp rules of `WhisperTimeStampLogitsProcessor` (pairs, monotonic, the first one at most
`max_initial_timestamp_index`, a timestamp whenever all timestamps together are likelier than any one text token).

The token ids come from the model folder's generation_config.json and tokenizer. Each processor reads only the
request's generated ids (`LogitsProcessor`: the sampler calls it once per token with the row's logits), so one
instance serves every request; transformers' `begin_index` is the first generated position here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from llmplug.core.protocols import LogitsProcessor

__all__ = ["WhisperRules", "SuppressTokens", "SuppressTokensAtBegin", "TimestampRules"]

_NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class SuppressTokens:
    """transformers' SuppressTokensLogitsProcessor: these tokens are never sampled."""

    token_ids: tuple[int, ...]

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[list(self.token_ids)] = _NEG_INF
        return logits


@dataclass(frozen=True, slots=True)
class SuppressTokensAtBegin:
    """transformers' SuppressTokensAtBeginLogitsProcessor: these tokens are not the first generated one."""

    token_ids: tuple[int, ...]

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not output_token_ids:
            logits[list(self.token_ids)] = _NEG_INF
        return logits


@dataclass(frozen=True, slots=True)
class TimestampRules:
    """transformers' WhisperTimeStampLogitsProcessor over one request's logits row [vocab]."""

    eos_token_id: int
    no_timestamps_token_id: int
    timestamp_begin: int  # the id of <|0.00|>; every id from here on is a timestamp
    max_initial_timestamp_index: int | None

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        begin, seq = self.timestamp_begin, output_token_ids
        logits[self.no_timestamps_token_id] = _NEG_INF
        last_is_timestamp = len(seq) >= 1 and seq[-1] >= begin
        penultimate_is_timestamp = len(seq) < 2 or seq[-2] >= begin
        # after two timestamps (one segment's end, the next one's start) text comes; after the timestamp that ends a
        # segment's text, the next segment's start or the end of text
        if last_is_timestamp:
            if penultimate_is_timestamp:
                logits[begin:] = _NEG_INF
            else:
                logits[: self.eos_token_id] = _NEG_INF
        stamps = [token for token in seq if token >= begin]
        if stamps:  # never back in time; a new segment starts after the last one ended
            floor = stamps[-1] if last_is_timestamp and not penultimate_is_timestamp else stamps[-1] + 1
            logits[begin:floor] = _NEG_INF
        if not seq:  # the first token is a timestamp, and an early one
            logits[:begin] = _NEG_INF
            if self.max_initial_timestamp_index is not None:
                logits[begin + self.max_initial_timestamp_index + 1 :] = _NEG_INF
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
        likelier = logprobs[begin:].logsumexp(dim=-1) > logprobs[:begin].max()  # [] bool, left on the device (no sync)
        logits[:begin].masked_fill_(likelier, _NEG_INF)
        return logits


@dataclass(frozen=True, slots=True)
class WhisperRules:
    """The ids Whisper's rules need, read once from the model folder."""

    eos_token_id: int
    no_timestamps_token_id: int
    timestamp_begin: int | None  # None: the tokenizer has no timestamp tokens (<|0.00|> ...)
    max_initial_timestamp_index: int | None
    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]
    time_precision: float  # seconds per timestamp step (one encoder position: 0.02 s)
    no_speech_token: str | None = None  # <|nospeech|> (<|nocaptions|> before large-v3); None: the tokenizer has none

    @classmethod
    def from_folder(cls, model_path: str, tokenizer: Any, time_precision: float) -> WhisperRules:
        """The rules of the folder's generation_config.json (transformers' defaults where it says nothing), the ids
        it leaves out taken from the tokenizer."""
        config = _generation_config(model_path)
        eos = config.get("eos_token_id", tokenizer.eos_token_id)
        eos = eos[0] if isinstance(eos, list) else eos
        no_timestamps = config.get("no_timestamps_token_id", tokenizer.convert_tokens_to_ids("<|notimestamps|>"))
        has_timestamps = tokenizer.convert_ids_to_tokens(no_timestamps + 1) == "<|0.00|>"
        no_speech = tokenizer.convert_ids_to_tokens(no_timestamps - 1)  # where transformers looks for it too
        return cls(int(eos), int(no_timestamps), no_timestamps + 1 if has_timestamps else None,
                   config.get("max_initial_timestamp_index"), tuple(config.get("suppress_tokens") or ()),
                   tuple(config.get("begin_suppress_tokens") or ()), time_precision,
                   no_speech if no_speech in ("<|nospeech|>", "<|nocaptions|>") else None)

    def logits_processors(self, timestamps: bool) -> list[LogitsProcessor]:
        """The processors of one request, in transformers' order; timestamps only where the tokenizer has them."""
        processors: list[LogitsProcessor] = []
        if self.begin_suppress_tokens:
            processors.append(SuppressTokensAtBegin(self.begin_suppress_tokens))
        if self.suppress_tokens:
            processors.append(SuppressTokens(self.suppress_tokens))
        if timestamps and self.timestamp_begin is not None:
            processors.append(TimestampRules(self.eos_token_id, self.no_timestamps_token_id, self.timestamp_begin,
                                             self.max_initial_timestamp_index))
        return processors


def _generation_config(model_path: str) -> dict[str, Any]:
    """The folder's generation_config.json; {} without one."""
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as file:
        return json.load(file)
