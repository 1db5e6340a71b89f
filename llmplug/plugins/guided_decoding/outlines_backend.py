"""The `outlines` guided-decoding backend (outlines-core): JSON schema, JSON object, regex and choice.

outlines-core compiles a regex into an index over the vocabulary; JSON schemas become regexes first.
Its `Vocabulary.from_pretrained` reads from the hub, so the vocabulary is built here from the model's
own tokenizer. It has no context-free grammars.
"""

from __future__ import annotations

import json
from functools import lru_cache

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from llmplug.core.params import GuidedDecodingParams
from llmplug.plugins.guided_decoding.common import Compiled, GuidedBackendBase, choice_regex, token_bytes

LLMPLUG_PLUGIN_API_VERSION = "1.1"


class OutlinesMatcher:
    """One request's outlines-core Guide; the end-of-sequence token is tracked here, as the Guide stops before it."""

    def __init__(self, index: outlines_core.Index, eos_token_id: int) -> None:
        self._guide = outlines_core.Guide(index)
        self._eos_token_id = eos_token_id
        self._ended = False

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; the end token only where the regex may end."""
        if self._ended:
            return False
        if token_id == self._eos_token_id:
            self._ended = self._guide.is_finished()
            return self._ended
        try:
            self._guide.advance(token_id, return_tokens=False)
        except ValueError:  # not allowed in this state
            return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`."""
        words = bitmask[row]
        self._guide.write_mask_into(words.data_ptr(), words.numel(), words.element_size())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens."""
        if self._ended and num_tokens > 0:
            self._ended, num_tokens = False, num_tokens - 1
        if num_tokens:
            self._guide.rollback_state(num_tokens)

    def is_terminated(self) -> bool:
        """True after the end-of-sequence token."""
        return self._ended


@lru_cache(maxsize=1)
def _byte_vocabulary() -> outlines_core.Vocabulary:
    """Every single byte as a token: enough to check that a regex compiles, at a fraction of the cost."""
    return outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


class OutlinesBackend(GuidedBackendBase):
    """Guided decoding with outlines-core (regular constraints only)."""

    name = "outlines"
    features = frozenset({"json", "json_object", "regex", "choice"})

    def _build_tokenizer_data(self) -> outlines_core.Vocabulary:
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(token_bytes(self.tokenizer, self.vocab_size)):
            if piece and token_id != self.eos_token_id:
                by_bytes.setdefault(piece, []).append(token_id)
        return outlines_core.Vocabulary(self.eos_token_id, by_bytes)

    def _regex(self, constraint: GuidedDecodingParams) -> str:
        kind = constraint.kind
        if kind in ("json", "json_object"):
            whitespace = None if constraint.whitespace_flexible else ""
            return build_regex_from_schema(json.dumps(constraint.schema), whitespace_pattern=whitespace)
        if kind == "regex":
            return constraint.regex
        return choice_regex(constraint.choice)

    def _check(self, constraint: GuidedDecodingParams) -> None:
        regex = self._regex(constraint)  # a schema outlines cannot turn into a regex fails here
        if constraint.kind in ("regex", "choice"):  # (a schema's regex is valid by construction, and can be huge)
            outlines_core.Index(regex, _byte_vocabulary())

    def _compile(self, constraint: GuidedDecodingParams) -> Compiled:
        index = outlines_core.Index(self._regex(constraint), self.tokenizer_data)
        return Compiled(lambda: OutlinesMatcher(index, self.eos_token_id))
