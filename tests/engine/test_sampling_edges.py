"""Sampling parameters at the edge of float32, found by fuzzing the server: each either samples sensibly or is
refused with a 400-style error naming it; none hangs a step or turns the logits into inf."""

from __future__ import annotations

import pytest

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from tests.engine.test_llm import generate_ids, hf_greedy
from tests.models.tiny_models import make_tiny

PROMPTS = [[5, 17, 9], [200, 3, 41, 8]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(str(tiny.path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("top_p", [5e-324, 1e-45, 1e-30])
def test_a_top_p_that_rounds_to_zero_keeps_only_the_most_likely_token(tiny, llm, top_p):
    """5e-324 is 0 in float32: the nucleus test once rejected every token and redrew forever."""
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=6, ignore_eos=True, seed=3)
    assert generate_ids(llm, PROMPTS, params) == [hf_greedy(tiny.hf_model, p, 6) for p in PROMPTS]


@pytest.mark.parametrize("penalty", [5e-324, 1e-30, 0.0099, 100.5, 1e300])
def test_a_repetition_penalty_that_overflows_the_logits_is_refused(penalty):
    with pytest.raises(InvalidRequestError, match=r"repetition_penalty=.* must be in \[0.01, 100\]") as info:
        SamplingParams(repetition_penalty=penalty)
    assert info.value.param == "repetition_penalty"


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_the_ends_of_the_repetition_penalty_range_sample(llm, penalty):
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 8 for o in outputs)
