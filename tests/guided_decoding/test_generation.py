"""Guided generation end to end: every backend x constraint kind, on a tiny random model and the real one.

Outputs are checked by independent tools (jsonschema, json.loads, re.fullmatch, membership, a Lark
parser), never by the backend that constrained them.
"""

from __future__ import annotations

import pytest

from llmplug import LLM, SamplingParams
from llmplug.core.params import GuidedDecodingParams
from llmplug.plugins.guided_decoding.common import regex_escape

from .conftest import BACKEND_KINDS, BACKENDS, CASES

NUM_SAMPLES = 20
TINY_PROMPT = '{"a":'
REAL_PROMPTS = {  # chat prompts that make the real model's answers short
    "json": 'Describe a dress as JSON: "flat" (true or false), "dress" (red, blue or tan), "n" (a list of booleans).',
    "json_object": 'Reply with a tiny JSON object: {"answer": 4} for 2+2.',
    "regex": "Make up a short email address.",
    "choice": "Is the sky blue? Answer true or false.",
    "grammar": "Write a short arithmetic expression.",
}


def sample(llm: LLM, prompt, guided: GuidedDecodingParams | None, max_tokens: int, **kwargs) -> list:
    """NUM_SAMPLES completions at temperature 1.0 with fixed seeds (one request, n children)."""
    params = SamplingParams(n=NUM_SAMPLES, temperature=1.0, seed=1234, max_tokens=max_tokens,
                            guided_decoding=guided, **kwargs)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs


def assert_all_valid(outputs, case) -> None:
    bad = [o.text for o in outputs if not case.valid(o.text)]
    assert not bad, f"{len(bad)} of {len(outputs)} {case.kind} outputs do not validate: {bad[:3]}"
    assert all(o.finish_reason == "stop" for o in outputs)


@pytest.mark.parametrize("backend, kind", BACKEND_KINDS)
def test_tiny_model_samples_validate(tiny_llm, backend, kind):
    case = CASES[kind]
    outputs = sample(tiny_llm, TINY_PROMPT, case.params(backend), max_tokens=400)
    assert_all_valid(outputs, case)


@pytest.mark.slow
@pytest.mark.parametrize("backend, kind", BACKEND_KINDS)
def test_default_model_samples_validate(smollm_llm, backend, kind):
    case = CASES[kind]
    prompt = smollm_llm.chat_prompt([{"role": "user", "content": REAL_PROMPTS[kind]}])
    outputs = sample(smollm_llm, prompt, case.params(backend), max_tokens=64)
    assert_all_valid(outputs, case)


def greedy_matches_unconstrained(llm: LLM, prompt: str, backend: str) -> None:
    """Where the grammar allows the greedy token at every step, constrained greedy output is unchanged."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    free = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    # the regex of exactly that text allows each greedy token, and then only the end of the sequence
    constraint = GuidedDecodingParams(regex=regex_escape(free.text), backend=backend)
    guided = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=9, guided_decoding=constraint),
                          use_tqdm=False)[0].outputs[0]
    assert free.text
    assert guided.text == free.text
    assert guided.token_ids[: len(free.token_ids)] == free.token_ids
    assert guided.finish_reason == "stop"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_model_greedy_is_unchanged_where_the_grammar_allows_it(tiny_llm, backend):
    greedy_matches_unconstrained(tiny_llm, TINY_PROMPT, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_default_model_greedy_is_unchanged_where_the_grammar_allows_it(smollm_llm, backend):
    greedy_matches_unconstrained(smollm_llm, "The capital of France is", backend)
