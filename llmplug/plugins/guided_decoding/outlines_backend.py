"""The `outlines` guided-decoding backend (outlines-core): JSON schema, JSON object, regex and choice.

outlines-core compiles a regex into an index over the vocabulary; JSON schemas become regexes first.
Its `Vocabulary.from_pretrained` reads from the hub, so the vocabulary is built here from the model's
own tokenizer. It has no context-free grammars.
"""

from __future__ import annotations

import outlines_core
import torch

from llmplug.core.params import GuidedDecodingParams
from llmplug.plugins.guided_decoding.automata import outlines_index_states, outlines_regex
from llmplug.plugins.guided_decoding.common import Compiled, GuidedBackendBase, token_bytes

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


class OutlinesBackend(GuidedBackendBase):
    """Guided decoding with outlines-core (regular constraints only)."""

    name = "outlines"
    features = frozenset({"json", "json_object", "regex", "choice"})
    automaton_states = staticmethod(outlines_index_states)  # the index is the regex's whole DFA

    def _build_tokenizer_data(self) -> outlines_core.Vocabulary:
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(token_bytes(self.tokenizer, self.vocab_size)):
            if piece and token_id != self.eos_token_id:
                by_bytes.setdefault(piece, []).append(token_id)
        return outlines_core.Vocabulary(self.eos_token_id, by_bytes)

    def _check(self, constraint: GuidedDecodingParams) -> None:
        if constraint.kind in ("regex", "choice"):
            outlines_index_states(constraint)  # over single bytes: a fraction of the compile's cost
        else:
            outlines_regex(constraint)  # a schema outlines cannot turn into a regex fails here (its regex is valid)

    def _compile(self, constraint: GuidedDecodingParams) -> Compiled:
        index = outlines_core.Index(outlines_regex(constraint), self.tokenizer_data)
        return Compiled(lambda: OutlinesMatcher(index, self.eos_token_id))
