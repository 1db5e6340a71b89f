"""The backends on their own: token bytes, matchers (accept, bitmask, rollback, termination) and validation."""

from __future__ import annotations

import pytest
import torch

from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import GuidedDecodingParams
from llmplug.core.plugins import get_registry
from llmplug.core.protocols import CompiledGrammar, GrammarMatcher, GuidedDecodingBackend
from llmplug.plugins.guided_decoding.common import choice_regex, regex_escape, token_bytes

from .conftest import BACKENDS, make_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_char_tokenizer()


def backend(name: str, tokenizer) -> GuidedDecodingBackend:
    return get_registry().load("llmplug.guided_decoding", name)(tokenizer, len(tokenizer) + 5, tokenizer.eos_token_id)


def allowed_ids(matcher: GrammarMatcher, vocab_size: int) -> set[int]:
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return {t for t in range(vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}


def compact(kind_value: dict) -> GuidedDecodingParams:
    return GuidedDecodingParams(**kind_value, whitespace_flexible=False)


def test_token_bytes_reassemble_the_text(tokenizer):
    text = '{"ab":true} (1+2)'
    pieces = token_bytes(tokenizer, len(tokenizer) + 5)
    assert b"".join(pieces[t] for t in tokenizer.encode(text)) == text.encode()
    assert pieces[tokenizer.eos_token_id] is None and pieces[-1] is None  # special, and past the vocabulary


def test_regex_escape_and_choice_regex_match_exactly_their_text():
    import re

    text = "a.b*c (d)[e]{f}|g?+^$\\"
    assert re.fullmatch(regex_escape(text), text) and not re.fullmatch(regex_escape(text), "a_b*c (d)[e]{f}|g?+^$\\")
    assert re.fullmatch(choice_regex(["x+y", "z"]), "x+y") and not re.fullmatch(choice_regex(["x+y", "z"]), "xxy")


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_implements_the_protocols(name, tokenizer):
    b = backend(name, tokenizer)
    assert isinstance(b, GuidedDecodingBackend) and b.name == name
    compiled = b.compile(compact({"regex": "ab|cd"}))
    assert isinstance(compiled, CompiledGrammar) and isinstance(compiled.matcher(), GrammarMatcher)


@pytest.mark.parametrize("name", BACKENDS)
def test_matcher_masks_accepts_rolls_back_and_terminates(name, tokenizer):
    b = backend(name, tokenizer)
    vocab = b.vocab_size
    ids = {ch: tokenizer.convert_tokens_to_ids(ch) for ch in "abcd"}
    matcher = b.compile(compact({"regex": "ab|cd"})).matcher()
    start = allowed_ids(matcher, vocab)
    assert start == {ids["a"], ids["c"]}
    assert not matcher.accept_token(ids["b"])  # forbidden: refused, state unchanged
    assert matcher.accept_token(ids["a"]) and allowed_ids(matcher, vocab) == {ids["b"]}
    matcher.rollback(1)
    assert allowed_ids(matcher, vocab) == start
    assert matcher.accept_token(ids["c"]) and matcher.accept_token(ids["d"])
    eos = tokenizer.eos_token_id
    assert eos in allowed_ids(matcher, vocab) or matcher.is_terminated()
    if not matcher.is_terminated():
        assert matcher.accept_token(eos) and matcher.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
def test_end_of_sequence_only_where_the_grammar_may_end(name, tokenizer):
    matcher = backend(name, tokenizer).compile(compact({"regex": "a+"})).matcher()
    eos, a = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("a")
    assert eos not in allowed_ids(matcher, len(tokenizer))
    assert matcher.accept_token(a)
    assert allowed_ids(matcher, len(tokenizer)) == {a, eos}


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("bad, named", [({"regex": "(ab"}, "regex"), ({"json": {"type": "nonsense"}}, "json")])
def test_invalid_constraints_are_named(name, tokenizer, bad, named):
    with pytest.raises(InvalidRequestError, match=f"guided_decoding {named} rejected by the {name} backend"):
        backend(name, tokenizer).validate(compact(bad))


@pytest.mark.parametrize("name, constraint, feature", [
    ("outlines", {"grammar": 'start: "a"'}, "grammar (Lark)"),
    ("lm_format_enforcer", {"grammar": 'root ::= "a"'}, "grammar (EBNF)"),
    ("lm_format_enforcer", {"json_object": True}, "json_object"),
    ("xgrammar", {"grammar": 'start: "a"'}, "grammar (Lark)"),
])
def test_backends_report_what_they_lack(name, tokenizer, constraint, feature):
    assert backend(name, tokenizer).unsupported_feature(compact(constraint)) == feature


@pytest.mark.parametrize("name", BACKENDS)
def test_json_is_compact_unless_whitespace_is_flexible(name, tokenizer):
    b = backend(name, tokenizer)
    space, brace = tokenizer.convert_tokens_to_ids("Ġ"), tokenizer.convert_tokens_to_ids("{")
    for flexible in (False, True):
        schema = {"type": "object", "properties": {"a": {"type": "boolean"}}}
        matcher = b.compile(GuidedDecodingParams(json=schema, whitespace_flexible=flexible)).matcher()
        assert matcher.accept_token(brace)
        assert (space in allowed_ids(matcher, b.vocab_size)) == flexible
