"""Choosing a backend per request: `auto`, the configured default, per-request overrides and clear errors."""

from __future__ import annotations

import pytest

from llmplug.core.config import DecodingConfig
from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import GuidedDecodingParams, SamplingParams
from llmplug.engine.guided_decoding import GuidedDecodingManager

from .conftest import EBNF_GRAMMAR, LARK_GRAMMAR, make_char_tokenizer


@pytest.fixture(scope="module")
def manager():
    tokenizer = make_char_tokenizer()
    manager = GuidedDecodingManager(tokenizer, len(tokenizer), tokenizer.eos_token_id, DecodingConfig())
    yield manager
    manager.shutdown()


def chosen(manager: GuidedDecodingManager, **constraint) -> str:
    return manager.select(manager.resolve(GuidedDecodingParams(**constraint))).name


def test_auto_picks_per_request_a_backend_that_supports_the_constraint(manager):
    assert chosen(manager, json={"type": "object"}) == "xgrammar"
    assert chosen(manager, grammar=EBNF_GRAMMAR) == "xgrammar"
    assert chosen(manager, grammar=LARK_GRAMMAR) == "llguidance"  # xgrammar reads no Lark


def test_request_and_config_choose_the_backend(manager):
    assert chosen(manager, regex="a+", backend="outlines") == "outlines"
    assert chosen(manager, grammar=EBNF_GRAMMAR, backend="llguidance") == "llguidance"  # GBNF converted to Lark
    tokenizer = manager.tokenizer
    configured = GuidedDecodingManager(tokenizer, len(tokenizer), tokenizer.eos_token_id,
                                       DecodingConfig(guided_backend="lm_format_enforcer"))
    assert chosen(configured, choice=["a", "b"]) == "lm_format_enforcer"
    configured.shutdown()


def test_unsupported_feature_names_it_and_the_backends_that_can(manager):
    with pytest.raises(InvalidRequestError) as error:
        chosen(manager, grammar=LARK_GRAMMAR, backend="outlines")
    message = str(error.value)
    assert "grammar (Lark) is not supported by the outlines backend" in message
    assert "backends that can: llguidance" in message and "xgrammar" not in message


def test_invalid_constraint_and_unknown_backend_are_clear_errors(manager):
    with pytest.raises(InvalidRequestError, match="guided_decoding regex rejected by the xgrammar backend"):
        chosen(manager, regex="(ab", backend="xgrammar")
    with pytest.raises(InvalidRequestError, match="guided_decoding regex rejected by"):
        chosen(manager, regex="(ab")  # auto: every capable backend rejects it, each says why
    with pytest.raises(InvalidRequestError, match="not a valid JSON schema at properties/a/type"):
        manager.prepare(GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}})).result()
    with pytest.raises(InvalidRequestError, match="'nope' is not available"):
        chosen(manager, regex="a", backend="nope")


@pytest.mark.parametrize("bad, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"json": "{not json"}, "guided_decoding.json is not valid JSON"),
    ({"choice": []}, "non-empty list"),
    ({"regex": ""}, "non-empty string"),
])
def test_params_reject_malformed_constraints(bad, message):
    with pytest.raises(InvalidRequestError, match=message):
        GuidedDecodingParams(**bad)


def test_min_tokens_cannot_fight_the_grammar():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=3, guided_decoding=GuidedDecodingParams(choice=["a"]))


def test_whitespace_default_comes_from_the_config(manager):
    assert manager.resolve(GuidedDecodingParams(json_object=True)).whitespace_flexible is False
    assert manager.resolve(GuidedDecodingParams(json_object=True, whitespace_flexible=True)).whitespace_flexible
    loose = GuidedDecodingManager(None, 10, 0, DecodingConfig(compact_json=False))
    assert loose.resolve(GuidedDecodingParams(json_object=True)).whitespace_flexible is True
    loose.shutdown()
