"""What the four guided-decoding backends share: the base class, token bytes, regex escaping.

Each backend subclasses `GuidedBackendBase`, declares the constraint features it supports, and
implements `_check` (cheap, no tokenizer data), `_build_tokenizer_data` (once per engine) and
`_compile`. The base class turns any library error into an InvalidRequestError that names the
backend and the constraint kind, so bad input always reaches the user as a clear 400.
"""

from __future__ import annotations

import abc
import threading
from functools import lru_cache
from typing import Any, Callable, Sequence

from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import GuidedDecodingParams
from llmplug.core.protocols import CompiledGrammar, GrammarMatcher

__all__ = [
    "Compiled",
    "GuidedBackendBase",
    "byte_level_chars",
    "choice_regex",
    "constraint_feature",
    "regex_escape",
    "token_bytes",
]

# Feature names: the constraint kinds, with grammars split by syntax.
EBNF_GRAMMAR = "grammar (EBNF)"
LARK_GRAMMAR = "grammar (Lark)"


def constraint_feature(constraint: GuidedDecodingParams) -> str:
    """The feature a constraint needs: its kind, or for a grammar its syntax (GBNF-style `::=` is EBNF)."""
    if constraint.kind != "grammar":
        return constraint.kind
    return EBNF_GRAMMAR if "::=" in constraint.grammar else LARK_GRAMMAR


class Compiled:
    """A compiled grammar: the backend's compiled object, bound into the function that makes each matcher."""

    def __init__(self, make_matcher: Callable[[], GrammarMatcher]) -> None:
        self._make_matcher = make_matcher

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        return self._make_matcher()


class GuidedBackendBase(abc.ABC):
    """A guided-decoding backend with lazily built, cached tokenizer data and uniform error reporting."""

    name: str = ""
    features: frozenset[str] = frozenset()  # what `constraint_feature` values this backend handles

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's vocabulary)
        self.eos_token_id = eos_token_id
        self._tokenizer_data: Any = None
        self._lock = threading.Lock()  # compiles run in a thread pool: build the data once

    @property
    def tokenizer_data(self) -> Any:
        """The backend's view of the tokenizer, built on first use and kept for the engine's life."""
        with self._lock:
            if self._tokenizer_data is None:
                self._tokenizer_data = self._build_tokenizer_data()
            return self._tokenizer_data

    def unsupported_feature(self, constraint: GuidedDecodingParams) -> str | None:
        """The feature of `constraint` this backend lacks, or None."""
        feature = constraint_feature(constraint)
        return None if feature in self.features else feature

    def validate(self, constraint: GuidedDecodingParams) -> None:
        """Raise InvalidRequestError when the library rejects the constraint (cheap: no tokenizer data)."""
        self._reporting(self._check, constraint)

    def compile(self, constraint: GuidedDecodingParams) -> CompiledGrammar:
        """Compile the constraint against the tokenizer."""
        return self._reporting(self._compile, constraint)

    def _reporting(self, fn: Any, constraint: GuidedDecodingParams) -> Any:
        try:
            return fn(constraint)
        except InvalidRequestError:
            raise
        except Exception as exc:  # the libraries raise their own types (RuntimeError, ValueError, ...)
            reason = str(exc).strip() or type(exc).__name__  # some libraries raise without a message
            raise InvalidRequestError(
                f"guided_decoding {constraint.kind} rejected by the {self.name} backend: {reason}"
            ) from exc

    # --- what each backend implements ---

    @abc.abstractmethod
    def _check(self, constraint: GuidedDecodingParams) -> None:
        """Raise when the library rejects `constraint` (no tokenizer data needed)."""

    @abc.abstractmethod
    def _build_tokenizer_data(self) -> Any:
        """The library's view of the tokenizer."""

    @abc.abstractmethod
    def _compile(self, constraint: GuidedDecodingParams) -> CompiledGrammar:
        """Compile `constraint` against the tokenizer data."""


# --- regexes ------------------------------------------------------------------------------------

_REGEX_SPECIAL = frozenset(".^$|?*+()[]{}\\")


def regex_escape(text: str) -> str:
    """`text` as a regex matching exactly it, escaping only what every backend's dialect treats as special."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def choice_regex(choices: Sequence[str]) -> str:
    """A regex matching exactly one of `choices`."""
    return "(" + "|".join(regex_escape(c) for c in choices) + ")"


# --- tokens as bytes ----------------------------------------------------------------------------


@lru_cache(maxsize=1)
def byte_level_chars() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_types(tokenizer: Any) -> set[str]:
    """The types of the fast tokenizer's decoder (and of the decoders of a Sequence)."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    if not decoder:
        return set()
    return {decoder["type"], *(d["type"] for d in decoder.get("decoders", []))}


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """The bytes each token id stands for; None for special and added tokens and ids the tokenizer lacks.

    Reads the vocabulary directly (byte-level BPE, SentencePiece's "▁" and <0xXX> byte tokens), so it
    costs one pass over the vocabulary instead of a decode call per token.
    """
    kinds = _decoder_types(tokenizer)
    added = set(getattr(tokenizer, "added_tokens_decoder", {}) or ()) | set(tokenizer.all_special_ids)
    n = min(vocab_size, len(tokenizer))
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    byte_level = byte_level_chars() if "ByteLevel" in kinds else None
    result: list[bytes | None] = [None] * vocab_size
    for token_id, piece in enumerate(pieces):
        if token_id in added or piece is None:
            continue
        if byte_level is not None:
            result[token_id] = bytes(byte_level[c] for c in piece) if all(c in byte_level for c in piece) else None
        elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            result[token_id] = bytes([int(piece[3:5], 16)])
        else:
            result[token_id] = piece.replace("▁", " ").encode("utf-8")
    return result
