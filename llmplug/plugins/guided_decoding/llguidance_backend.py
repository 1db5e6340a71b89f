"""The `llguidance` guided-decoding backend: JSON schema, JSON object, regex, choice, Lark and EBNF grammars."""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from llmplug.core.params import GuidedDecodingParams
from llmplug.plugins.guided_decoding.common import (
    EBNF_GRAMMAR,
    LARK_GRAMMAR,
    Compiled,
    GuidedBackendBase,
    choice_regex,
    constraint_feature,
)

LLMPLUG_PLUGIN_API_VERSION = "1.1"


class LLGuidanceMatcher:
    """One request's llguidance matcher; it terminates on the end-of-sequence token, as the others do."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int) -> None:
        self._matcher = matcher
        self._eos_token_id = eos_token_id
        self._ended = False

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; a forbidden one is refused before consume_token (which would leave the matcher
        in an error state for good), and the end token only where the grammar may end."""
        if token_id == self._eos_token_id:
            self._ended = self._matcher.is_accepting() and self._matcher.consume_token(token_id)
            return self._ended
        return self._matcher.try_consume_tokens([token_id]) == 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens."""
        self._matcher.rollback(num_tokens)
        self._ended = self._ended and num_tokens == 0

    def is_terminated(self) -> bool:
        """True after the end-of-sequence token. A complete grammar (`is_stopped`) allows only that token, so
        the request still samples it: a finished request's last token is always its end token."""
        return self._ended


class LLGuidanceBackend(GuidedBackendBase):
    """Guided decoding with llguidance (grammars in Lark syntax, or GBNF-style EBNF converted to Lark)."""

    name = "llguidance"
    features = frozenset({"json", "json_object", "regex", "choice", EBNF_GRAMMAR, LARK_GRAMMAR})

    def _build_tokenizer_data(self) -> llguidance.LLTokenizer:
        return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id)

    def _grammar(self, constraint: GuidedDecodingParams) -> str:
        """The llguidance grammar text of a constraint (tokenizer-independent)."""
        kind = constraint.kind
        if kind in ("json", "json_object"):
            options = {"whitespace_flexible": constraint.whitespace_flexible}
            return llguidance.LLMatcher.grammar_from_json_schema(constraint.schema, overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex(choice_regex(constraint.choice))
        lark = constraint.grammar
        if constraint_feature(constraint) == EBNF_GRAMMAR:
            lark = gbnf_to_lark(lark)
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def _check(self, constraint: GuidedDecodingParams) -> None:
        error = llguidance.LLMatcher.validate_grammar(self._grammar(constraint))
        if error:
            raise ValueError(error)

    def _compile(self, constraint: GuidedDecodingParams) -> Compiled:
        # building the matcher is the costly part; each request gets a copy of this one at the start
        template = llguidance.LLMatcher(self.tokenizer_data, self._grammar(constraint), log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        return Compiled(lambda: LLGuidanceMatcher(template.deep_copy(), self.eos_token_id))
