"""The budget on what a backend builds whole: a runaway automaton costs its own request a bounded 400, and
the same manager serves the next constraint."""

from __future__ import annotations

import time

import pytest
import torch

from llmplug.core.config import DecodingConfig
from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import GuidedDecodingParams
from llmplug.engine.grammar_sandbox import SandboxTimeout, run_sandboxed
from llmplug.engine.guided_decoding import GuidedDecodingManager
from llmplug.plugins.guided_decoding.automata import fsm_states, outlines_index_states

from .conftest import make_char_tokenizer

RUNAWAY = "(a|b)*a(a|b){16}"  # its deterministic automaton has 2^17 states


@pytest.fixture(scope="module")
def tokenizer():
    return make_char_tokenizer()


def manager_with(tokenizer, **limits) -> GuidedDecodingManager:
    return GuidedDecodingManager(tokenizer, len(tokenizer), tokenizer.eos_token_id, DecodingConfig(**limits))


def test_sandbox_returns_results_and_errors_and_kills_what_runs_past_its_budget():
    assert run_sandboxed(len, "abc", 10) == 3
    with pytest.raises(TypeError):
        run_sandboxed(len, 5, 10)
    start = time.monotonic()
    with pytest.raises(SandboxTimeout):
        run_sandboxed(time.sleep, 60, 0.5)
    assert time.monotonic() - start < 10
    assert run_sandboxed(len, "abcd", 10) == 4  # a fresh worker


def test_automaton_sizes_are_the_libraries_own():
    # (a|b)*a(a|b){3} remembers the last four letters: 2^4 states at least (outlines does not minimize)
    for states in (fsm_states, outlines_index_states):
        assert 2**4 <= states(GuidedDecodingParams(regex="(a|b)*a(a|b){3}")) <= 2**6
    schema = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(a|b)*a(a|b){3}"}}}
    assert fsm_states(GuidedDecodingParams(json=schema)) == fsm_states(GuidedDecodingParams(regex="(a|b)*a(a|b){3}"))


def test_a_runaway_regex_is_refused_within_the_time_budget_and_the_next_request_compiles(tokenizer):
    manager = manager_with(tokenizer, guided_compile_timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(InvalidRequestError, match=r"longer than 1 s .*guided_compile_timeout_s"):
            manager.prepare(GuidedDecodingParams(regex=RUNAWAY, backend="lm_format_enforcer")).result(timeout=60)
        assert time.monotonic() - start < 30  # the budget, the sandbox's start and the imports
        compiled = manager.prepare(GuidedDecodingParams(regex="[ab]{3}", backend="lm_format_enforcer")).result(60)
        assert compiled.matcher().accept_token(tokenizer.convert_tokens_to_ids("a"))
    finally:
        manager.shutdown()


def test_an_automaton_past_the_state_limit_is_refused_by_count(tokenizer):
    manager = manager_with(tokenizer, guided_max_states=100)
    try:
        for backend in ("outlines", "lm_format_enforcer"):
            with pytest.raises(InvalidRequestError, match=r"has \d+ states, more than 100 .*guided_max_states"):
                manager.prepare(GuidedDecodingParams(regex="(a|b)*a(a|b){8}", backend=backend)).result(timeout=60)
        # xgrammar and llguidance build lazily: the same regex is theirs to serve
        manager.prepare(GuidedDecodingParams(regex="(a|b)*a(a|b){8}", backend="xgrammar")).result(timeout=60)
    finally:
        manager.shutdown()


def test_lm_format_enforcer_builds_a_regex_automaton_once_per_constraint(tokenizer, monkeypatch):
    import interegular

    built = []
    parse = interegular.parse_pattern
    monkeypatch.setattr(interegular, "parse_pattern", lambda regex: built.append(regex) or parse(regex))
    manager = manager_with(tokenizer)
    try:
        compiled = manager.prepare(GuidedDecodingParams(regex="[ab]{2,3}", backend="lm_format_enforcer")).result(60)
        count = len(built)
        for _ in range(3):
            compiled.matcher()
        assert len(built) == count  # matchers share the compiled automaton
    finally:
        manager.shutdown()


def test_lm_format_enforcer_builds_a_schemas_patterns_while_compiling(tokenizer, monkeypatch):
    """The automata of a schema's `pattern`s are built in the compile pool, not on first use in a step."""
    import interegular

    built = []
    parse = interegular.parse_pattern
    monkeypatch.setattr(interegular, "parse_pattern", lambda regex: built.append(regex) or parse(regex))
    schema = {"type": "object", "properties": {"label": {"type": "string", "pattern": "^[ab]{1,3}$"}},
              "required": ["label"], "additionalProperties": False}
    manager = manager_with(tokenizer)
    try:
        compiled = manager.prepare(GuidedDecodingParams(json=schema, backend="lm_format_enforcer")).result(60)
        assert built == ["[ab]{1,3}"]
        matcher = compiled.matcher()
        bitmask = torch.full((1, (len(tokenizer) + 31) // 32), -1, dtype=torch.int32)
        for char in '{"label":"ab':
            matcher.fill_bitmask(bitmask, 0)
            assert matcher.accept_token(tokenizer.convert_tokens_to_ids(char)), char
        assert built == ["[ab]{1,3}"]  # nothing built while generating
    finally:
        manager.shutdown()
