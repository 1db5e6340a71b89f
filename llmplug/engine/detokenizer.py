"""Incremental detokenization of one completion, with stop strings.

Text is decoded in context, as vLLM does: after the tail of the prompt (its last 4 or more tokens, as
few as decode to whole characters). It grows token by token and always equals the part of
`tokenizer.decode(tail + output_ids, skip_special_tokens=...)` after `tokenizer.decode(tail)`, which is
how the output reads after the whole prompt. Decoded alone, the output would lose what depends on the
token before it: a sentencepiece tokenizer (Llama 2, Mistral) drops the leading space of the first
output token, so an answer would be glued to its prompt. A fast tokenizer decodes through tokenizers'
`DecodeStream` (primed with the tail); any other through the same prefix / read-offset scheme written
in Python. Both hold back text while it ends in an incomplete UTF-8 sequence (a character split across
tokens) and release it whole.

A byte-fallback (sentencepiece) decoder is not monotonic on invalid UTF-8: a run of byte tokens
that stops being valid turns into one U+FFFD per byte, rewriting text already emitted. Streams of
valid text are unaffected; for the rest `flush` at the end makes the final text equal the decode.

Stop strings: after each `update`, `check_stop` searches only the new text plus the (longest stop
string - 1) characters before it, truncates the text at the earliest match (keeping the stop string
when `include_stop_str_in_output`) and reports the string. Streaming never sends text it may have to
take back: `get_next_output_text` holds back the longest tail that is a prefix of a stop string, and
releases it when the next token shows it is not one (or when the request finishes). Neither grows
with the number of stop strings in Python: the search is one compiled regular expression (the
strings longest first, so the longest of those starting at the earliest match wins), the hold-back a
binary search in the sorted strings per candidate tail length.
"""

from __future__ import annotations

import bisect
import re
from typing import Any, Callable, Sequence

from llmplug.core.params import SamplingParams

try:  # tokenizers is a dependency of transformers; without it, only the Python scheme is used
    from tokenizers import Tokenizer as _FastTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover
    _FastTokenizer, DecodeStream = None, None

_REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence
_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error when earlier text changes


def fast_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind `tokenizer` (itself, or a transformers fast tokenizer's), if any."""
    if _FastTokenizer is None:
        return None
    if isinstance(tokenizer, _FastTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, _FastTokenizer) else None


MIN_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS = 4, 24  # how much of the prompt's tail output is decoded after


def prompt_tail(prompt_token_ids: list[int], decode: Callable[[list[int]], str]) -> list[int]:
    """The shortest tail of the prompt, of at least MIN_CONTEXT_TOKENS tokens, that decodes to whole
    characters (its first token does not continue a character split across tokens); the longest one
    tried when none does."""
    if len(prompt_token_ids) <= MIN_CONTEXT_TOKENS:
        return list(prompt_token_ids)
    longest = min(len(prompt_token_ids), MAX_CONTEXT_TOKENS)
    for n in range(MIN_CONTEXT_TOKENS, longest + 1):
        tail = list(prompt_token_ids[-n:])
        if _REPLACEMENT not in decode(tail):
            return tail
    return list(prompt_token_ids[-longest:])


class StreamDecoder:
    """Decodes through tokenizers' DecodeStream (Rust), recovering from its invalid-prefix error."""

    def __init__(self, backend: Any, skip_special_tokens: bool, context: Sequence[int] = ()) -> None:
        self.backend = backend
        self.skip_special_tokens = skip_special_tokens
        self.stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str | None:
        """Text completed by one more token, or None while it is incomplete."""
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as e:  # the stream cannot continue: start a fresh one from this token
            if _INVALID_PREFIX not in str(e):
                raise
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.backend, token_id)

    def decode(self, token_ids: list[int]) -> str:
        """Plain decode of a token list (used to flush at the end)."""
        return self.backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class OffsetDecoder:
    """The prefix / read-offset scheme (as vLLM's for slow tokenizers), over `tokenizer.decode`.

    Decodes the window from `prefix_offset` twice (to `read_offset` and to the end) and emits the
    difference once it no longer ends in an incomplete character; the window's first token gives the
    context that decoders need for spaces.
    """

    def __init__(self, tokenizer: Any, params: SamplingParams, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": params.skip_special_tokens}
        if not params.spaces_between_special_tokens:  # only slow tokenizers know this argument
            self.kwargs["spaces_between_special_tokens"] = False
        self.token_ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)

    def step(self, token_id: int) -> str | None:
        """Text completed by one more token, or None while it is incomplete."""
        self.token_ids.append(token_id)
        prefix = self.decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self.decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix) :]

    def decode(self, token_ids: list[int]) -> str:
        """Plain decode of a token list."""
        return self.tokenizer.decode(token_ids, **self.kwargs)


class IncrementalDetokenizer:
    """The text of one completion, grown token by token, with stop-string checks."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        backend = fast_backend(tokenizer)
        decode = (backend or tokenizer).decode
        skip = params.skip_special_tokens
        self._context = prompt_tail(prompt_token_ids, lambda ids: decode(ids, skip_special_tokens=skip))
        if backend is not None:
            self._decoder: StreamDecoder | OffsetDecoder = StreamDecoder(
                backend, params.skip_special_tokens, self._context
            )
        else:
            self._decoder = OffsetDecoder(tokenizer, params, self._context)
        self._context_text = self._decoder.decode(self._context)
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = []
        self.stop = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._sorted_stops = sorted(set(self.stop))
        self._stop_starts = frozenset(s[0] for s in self.stop)
        by_length = sorted(self._sorted_stops, key=len, reverse=True)
        self._stop_pattern = re.compile("|".join(map(re.escape, by_length))) if self.stop else None
        self._text = ""
        self._sent = 0  # characters already handed out by get_next_output_text
        self.stopped = False  # a stop string matched: the text is final

    @property
    def output_text(self) -> str:
        """The completion's text so far (truncated at a matched stop string)."""
        return self._text

    def update(self, new_token_ids: list[int]) -> str:
        """Decode new tokens and return the text they complete (may be "" while a character is split)."""
        new_text = []
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            piece = self._decoder.step(token_id)
            if piece:
                new_text.append(piece)
        added = "".join(new_text)
        self._text += added
        return added

    def flush(self) -> str:
        """At the end of the completion: make the text equal the full decode; return what that added.

        Usually this adds bytes held back as an incomplete character (U+FFFD, as decode shows them).
        With a byte-fallback tokenizer it can also rewrite earlier text: a run of byte tokens that
        turns out not to be UTF-8 decodes to one U+FFFD per byte, which only the whole run reveals.
        Text truncated at a stop string stays as it is.
        """
        if self.stopped:
            return ""
        full = self._decode_in_context(self.token_ids)
        added = full[len(self._text) :] if full.startswith(self._text) else ""
        self._text = full
        self._sent = min(self._sent, len(full))
        return added

    def _decode_in_context(self, token_ids: list[int]) -> str:
        """The text of `token_ids` as it reads after the prompt's tail."""
        text = self._decoder.decode(self._context + token_ids)
        if text.startswith(self._context_text):
            return text[len(self._context_text) :]
        return self._decoder.decode(token_ids)  # the tail reads differently once followed: no context to strip

    def check_stop(self, new_text_len: int) -> str | None:
        """After `update` added `new_text_len` characters: the stop string now in the text, or None.

        Searches the new characters plus (longest stop - 1) before them, so a stop string spanning
        two updates is found; on a match the text is truncated and `stopped` is set. Stop strings are
        not checked until more than min_tokens tokens were generated (as vLLM).
        """
        if not self.stop or new_text_len <= 0 or self.stopped or len(self.token_ids) <= self.min_tokens:
            return None
        start = max(0, len(self._text) - new_text_len - (self._max_stop_len - 1))
        match = self._stop_pattern.search(self._text, start)
        if match is None:
            return None
        index, stop = match.start(), match.group()
        end = index + len(stop) if self.include_stop_str_in_output else index
        self._text = self._text[:end]
        self._sent = min(self._sent, end)
        self.stopped = True
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to put in the next RequestOutput: all of it, or what is new since the last call.

        While the request runs, a tail that could still grow into a stop string is held back.
        """
        end = len(self._text) if finished or self.stopped else len(self._text) - self._stop_prefix_len()
        end = max(end, self._sent)
        text = self._text[self._sent : end] if delta else self._text[:end]
        self._sent = end
        return text

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if self.include_stop_str_in_output:
            return 0  # the stop string itself is kept, so nothing sent would be taken back
        stops = self._sorted_stops
        for length in range(min(self._max_stop_len - 1, len(self._text)), 0, -1):
            if self._text[-length] not in self._stop_starts:
                continue
            tail = self._text[-length:]
            i = bisect.bisect_left(stops, tail)  # the first stop string >= tail starts with it, if any does
            if i < len(stops) and stops[i].startswith(tail):
                return length
        return 0
