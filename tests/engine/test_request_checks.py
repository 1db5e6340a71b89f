"""Every class of bad request is a ValueError (InvalidRequestError) from `LLM` naming the field, raised before
anything is queued; the next request gets the same answer as before, and nothing leaks."""

from __future__ import annotations

import pytest

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError

from .conftest import EXTRA_TOKEN

VOCAB = 420
MAX_MODEL_LEN = 128
PROMPT = "Once upon a time the robot said"
GOOD = SamplingParams(temperature=0.0, max_tokens=8)

# name -> (prompt or None for PROMPT, SamplingParams fields, the field the error names)
BAD_REQUESTS = {
    "negative stop token id": (None, {"stop_token_ids": [-1]}, "stop_token_ids"),
    "stop token id past the vocabulary": (None, {"stop_token_ids": [2, VOCAB]}, "stop_token_ids"),
    "stop token id of the wrong type": (None, {"stop_token_ids": ["2"]}, "stop_token_ids"),
    "allowed token id past the vocabulary": (None, {"allowed_token_ids": [5, VOCAB + 3]}, "allowed_token_ids"),
    "no allowed token": (None, {"allowed_token_ids": []}, "allowed_token_ids"),
    "bad word past the vocabulary": (None, {"bad_words": ["fox", EXTRA_TOKEN]}, "bad_words"),
    "empty bad word": (None, {"bad_words": [""]}, "bad_words"),
    "logit_bias key past the vocabulary": (None, {"logit_bias": {VOCAB: 2.0}}, "logit_bias"),
    "negative logit_bias key": (None, {"logit_bias": {-4: 2.0}}, "logit_bias"),
    "infinite logit_bias": (None, {"logit_bias": {3: float("inf")}}, "logit_bias"),
    "prompt token id past the vocabulary": ({"prompt_token_ids": [1, 5, VOCAB]}, {}, "prompt"),
    "negative prompt token id": ({"prompt_token_ids": [1, -7]}, {}, "prompt"),
    "prompt token id of the wrong type": ({"prompt_token_ids": [1, "5"]}, {}, "prompt"),
    "empty prompt": ({"prompt_token_ids": []}, {}, "prompt"),
    "prompt filling the context": ({"prompt_token_ids": [5] * MAX_MODEL_LEN}, {}, "prompt"),
    "logprobs above max_logprobs": (None, {"logprobs": 21}, "logprobs"),
    "prompt_logprobs above max_logprobs": (None, {"prompt_logprobs": 21}, "prompt_logprobs"),
    "negative logprobs": (None, {"logprobs": -1}, "logprobs"),
    "min_tokens above max_tokens": (None, {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    "max_tokens beyond the context": (None, {"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    "n of zero": (None, {"n": 0}, "n"),
    "n above max_n": (None, {"n": 129}, "n"),
    "n of the wrong type": (None, {"n": 1.5}, "n"),
    "too many stop strings": (None, {"stop": [f"s{i}" for i in range(65)]}, "stop"),
    "stop string too long": (None, {"stop": ["y" * 257]}, "stop"),
    "too many allowed token ids": (None, {"allowed_token_ids": [5] * 8193}, "allowed_token_ids"),
    "too many bad words": (None, {"bad_words": [f"w{i}" for i in range(129)]}, "bad_words"),
    "bad word too long": (None, {"bad_words": ["z" * 257]}, "bad_words"),
    "empty stop string": (None, {"stop": ["ok", ""]}, "stop"),
    "infinite temperature": (None, {"temperature": float("inf")}, "temperature"),
    "nan top_p": (None, {"top_p": float("nan")}, "top_p"),
}


@pytest.fixture(scope="module")
def llm(sentencepiece_llama):
    engine = LLM(str(sentencepiece_llama), dtype="float32", block_size=4)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def answer(llm):
    """The normal request's answer, before any bad one."""
    return llm.generate(PROMPT, GOOD, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_request_is_a_value_error_naming_the_field_and_the_next_request_is_unchanged(llm, answer, name):
    prompt, fields, field = BAD_REQUESTS[name]
    with pytest.raises(ValueError) as info:
        llm.generate([PROMPT, prompt or PROMPT], SamplingParams(**{"max_tokens": 8, **fields}), use_tqdm=False)
    assert isinstance(info.value, InvalidRequestError) and info.value.param == field
    assert field in str(info.value) or field == "prompt"
    assert not llm.llm_engine.has_unfinished_requests()  # the good prompt of the batch was taken back too
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    again = llm.generate(PROMPT, GOOD, use_tqdm=False)[0].outputs[0]
    assert (again.token_ids, again.text) == (answer.token_ids, answer.text)


def test_limits_are_configurable(sentencepiece_llama):
    llm = LLM(str(sentencepiece_llama), dtype="float32", block_size=4, max_logprobs=30,
              decoding={"max_n": 2, "max_stop_strings": 1, "max_stop_string_length": 3})
    out = llm.generate(PROMPT, SamplingParams(max_tokens=2, logprobs=30), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs[0]) >= 30
    for fields in ({"n": 3}, {"stop": ["a", "b"]}, {"stop": ["abcd"]}, {"logprobs": 31}):
        with pytest.raises(InvalidRequestError):
            llm.generate(PROMPT, SamplingParams(**fields), use_tqdm=False)
    llm.shutdown()
