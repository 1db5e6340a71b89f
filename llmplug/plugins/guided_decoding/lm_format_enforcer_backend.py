"""The `lm_format_enforcer` guided-decoding backend: JSON schema, regex and choice.

lm-format-enforcer walks a character-level parser over a prefix tree of the vocabulary. Its
transformers helper does not import on transformers 5, so its tokenizer data is built here from the
model's tokenizer directly. It has no context-free grammars. A regex's parser holds the regex's whole
automaton (interegular's, built in pure Python and exponential in the worst case): it is measured in the
grammar sandbox first (`automaton_states`), then built once per constraint and shared by every matcher.
"""

from __future__ import annotations

import interegular
import numpy as np
import torch
from lmformatenforcer import (
    CharacterLevelParser,
    CharacterLevelParserConfig,
    JsonSchemaParser,
    RegexParser,
    TokenEnforcer,
    TokenEnforcerTokenizerData,
)

from llmplug.core.params import GuidedDecodingParams
from llmplug.plugins.guided_decoding.automata import fsm_states, schema_patterns
from llmplug.plugins.guided_decoding.common import Compiled, GuidedBackendBase, choice_regex, token_bytes

LLMPLUG_PLUGIN_API_VERSION = "1.1"


class LMFormatEnforcerMatcher:
    """One request's TokenEnforcer, which looks states up by the tokens generated so far."""

    def __init__(
        self, data: TokenEnforcerTokenizerData, parser: CharacterLevelParser, eos_token_id: int, shared_cache: dict,
        compact: bool,
    ) -> None:
        self._enforcer = TokenEnforcer(data, parser)
        if compact:  # set after TokenEnforcer, which gives the parser a new config (the tokenizer's alphabet)
            parser.config.max_consecutive_whitespaces = 0
        # Allowed tokens per parser state are the same for every request of one constraint; sharing the
        # enforcer's cache spares each request recomputing them (lm-format-enforcer keys it by state).
        self._enforcer.allowed_token_cache = shared_cache
        self._eos_token_id = eos_token_id
        self._tokens: list[int] = []

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token."""
        if self.is_terminated() or token_id not in self._enforcer.get_allowed_tokens(self._tokens).allowed_tokens:
            return False
        self._tokens.append(token_id)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`."""
        # lm-format-enforcer's own bitmask mode is several times slower than its id lists on a large vocabulary
        bits = np.zeros(bitmask.shape[1] * 32, dtype=np.uint8)
        bits[np.asarray(self._enforcer.get_allowed_tokens(self._tokens).allowed_tokens, dtype=np.int64)] = 1
        bitmask[row] = torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4"))  # bit j of word i: 32 i + j

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens."""
        del self._tokens[len(self._tokens) - num_tokens :]

    def is_terminated(self) -> bool:
        """True after the end-of-sequence token."""
        return bool(self._tokens) and self._tokens[-1] == self._eos_token_id


class LMFormatEnforcerBackend(GuidedBackendBase):
    """Guided decoding with lm-format-enforcer (regular constraints and JSON)."""

    name = "lm_format_enforcer"
    # not json_object: for an object without listed properties, lm-format-enforcer allows a trailing comma
    # ({"a":1,}), which is not JSON; `auto` sends such requests to another backend
    features = frozenset({"json", "regex", "choice"})
    automaton_states = staticmethod(fsm_states)

    def _build_tokenizer_data(self) -> TokenEnforcerTokenizerData:
        regular = [
            (token_id, text, text.startswith(" "))
            for token_id, piece in enumerate(token_bytes(self.tokenizer, self.vocab_size))
            if piece and token_id != self.eos_token_id
            for text in (piece.decode("utf-8", errors="replace"),)
        ]
        return TokenEnforcerTokenizerData(regular, self._decode, self.eos_token_id, False, self.vocab_size)

    def _decode(self, token_ids: list[int]) -> str:
        # an incomplete UTF-8 sequence at the end is not text yet
        return self.tokenizer.decode(token_ids).rstrip("\ufffd")

    def _check(self, constraint: GuidedDecodingParams) -> None:
        # the syntax only: the automaton is measured in the sandbox and built by _compile, once
        if constraint.kind == "json":
            JsonSchemaParser(constraint.schema)
        else:
            interegular.parse_pattern(_regex(constraint))

    def _compile(self, constraint: GuidedDecodingParams) -> Compiled:
        # the state lives in each request's enforcer, which walks the vocabulary on demand; what one
        # constraint's matchers share is the tokenizer data, the regex's automaton and the allowed-token cache
        data, compact, cache = self.tokenizer_data, not constraint.whitespace_flexible, {}
        if constraint.kind == "json":
            context = _schema_context(constraint.schema, data)

            def parser() -> CharacterLevelParser:
                return JsonSchemaParser(context)
        else:
            automaton = RegexParser(_regex(constraint)).context

            def parser() -> CharacterLevelParser:
                return RegexParser(automaton)
        return Compiled(lambda: LMFormatEnforcerMatcher(data, parser(), self.eos_token_id, cache, compact))


def _schema_context(schema: dict, data: TokenEnforcerTokenizerData) -> JsonSchemaParser._Context:
    """A schema's parser context, shared by its matchers, with the automata of its `pattern`s built now (in the
    compile pool) and kept with it. Left alone, lm-format-enforcer builds each on first use, on the engine
    thread, into a cache that its contexts share for the whole process and never empties."""
    context = JsonSchemaParser(schema).context
    config = CharacterLevelParserConfig(alphabet=data.tokenizer_alphabet)  # as TokenEnforcer configures parsers
    context.regex_parser_cache = {key: RegexParser(key, config) for key in map(_unanchored, schema_patterns(schema))}
    return context


def _unanchored(pattern: str) -> str:
    """A `pattern` as lm-format-enforcer keys it: without a leading ^ and a trailing $."""
    return pattern.removeprefix("^").removesuffix("$")


def _regex(constraint: GuidedDecodingParams) -> str:
    return constraint.regex if constraint.kind == "regex" else choice_regex(constraint.choice)
