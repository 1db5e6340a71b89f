"""Every class of bad sampling field is a 400 naming the field, streaming or not, through the real openai
client; the next normal request gets the same answer as before. One row's failure in a step is a 500 (or
an error event) for that request only: the server stays healthy and its answers unchanged."""

from __future__ import annotations

import openai
import pytest

from tests.engine.faults import heal, nan_logits

from .conftest import ENGINE_KWARGS

VOCAB = 49152  # SmolLM2's vocabulary, which the tiny chat model uses
MESSAGES = [{"role": "user", "content": "Say something"}]
GOOD = {"max_tokens": 6, "temperature": 0}

# name -> (fields of the request, the param the 400 names); extra fields travel in extra_body as vLLM's do
BAD_FIELDS = {
    "negative stop token id": ({"stop_token_ids": [-1]}, "stop_token_ids"),
    "stop token id past the vocabulary": ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    "allowed token id past the vocabulary": ({"allowed_token_ids": [3, VOCAB + 7]}, "allowed_token_ids"),
    "no allowed token": ({"allowed_token_ids": []}, "allowed_token_ids"),
    "empty bad word": ({"bad_words": [" "]}, "bad_words"),
    "logit_bias key past the vocabulary": ({"logit_bias": {str(VOCAB): 1.0}}, "logit_bias"),
    "min_tokens above max_tokens": ({"min_tokens": 10, "max_tokens": 4}, "min_tokens"),
    "max_tokens beyond the context": ({"max_tokens": ENGINE_KWARGS["max_model_len"]}, "max_tokens"),
    "n above the limit": ({"n": 129}, "n"),
    "too many stop strings": ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
    "stop string too long": ({"stop": ["x" * 257]}, "stop"),
    "empty stop string": ({"stop": ["ok", ""]}, "stop"),
}
CHAT_ONLY = {"top_logprobs above the limit": ({"logprobs": True, "top_logprobs": 21}, "logprobs")}
COMPLETIONS_ONLY = {
    "logprobs above the limit": ({"logprobs": 21}, "logprobs"),
    "prompt token id past the vocabulary": ({"prompt": [1, VOCAB]}, "prompt"),
    "negative prompt token id": ({"prompt": [5, -3]}, "prompt"),
}
OPENAI_FIELDS = {"max_tokens", "n", "stop", "logit_bias", "logprobs", "top_logprobs", "prompt", "temperature"}


def split(fields: dict) -> tuple[dict, dict]:
    """The fields the openai client takes as arguments, and the rest for extra_body."""
    known = {k: v for k, v in fields.items() if k in OPENAI_FIELDS}
    return known, {k: v for k, v in fields.items() if k not in OPENAI_FIELDS}


def chat(server, stream: bool, **fields) -> str:
    known, extra = split({**GOOD, **fields})
    client = server.client()
    response = client.chat.completions.create(model=server.model, messages=MESSAGES, stream=stream,
                                              extra_body=extra, **known)
    if not stream:
        return response.choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in response if c.choices)


def complete(server, stream: bool, **fields) -> str:
    known, extra = split({"prompt": "Once upon a time", **GOOD, **fields})
    response = server.client().completions.create(model=server.model, stream=stream, extra_body=extra, **known)
    if not stream:
        return response.choices[0].text
    return "".join(c.choices[0].text for c in response if c.choices)


ENDPOINTS = {"chat": (chat, {**BAD_FIELDS, **CHAT_ONLY}), "completions": (complete, {**BAD_FIELDS, **COMPLETIONS_ONLY})}
CASES = [(endpoint, name) for endpoint, (_, bad) in ENDPOINTS.items() for name in sorted(bad)]


@pytest.fixture(scope="module")
def answers(server) -> dict[str, str]:
    """Each endpoint's greedy answer to the normal request, before any bad one."""
    return {endpoint: call(server, False) for endpoint, (call, _) in ENDPOINTS.items()}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint, name", CASES)
def test_bad_field_is_a_400_naming_it_and_the_next_request_is_unchanged(server, answers, endpoint, name, stream):
    call, bad = ENDPOINTS[endpoint]
    fields, param = bad[name]
    with pytest.raises(openai.BadRequestError) as info:
        call(server, stream, **fields)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and param in info.value.body["message"]
    assert call(server, stream) == answers[endpoint]
    server.wait_idle()


PROMPT = [1, 2, 3, 4, 5]  # as token ids, so the fault can pick this request out


def test_nan_logits_fail_only_that_request_with_its_reason(server, answers):
    client = server.client()
    nan_logits(server.engine, PROMPT)
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6)
        assert info.value.body["code"] == "request_failed" and "NaN" in info.value.body["message"]
        stream = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, stream=True)
        chunks = []
        with pytest.raises(openai.APIError, match="NaN"):
            for chunk in stream:
                chunks.append(chunk)
        assert chunks[-1].choices[0].finish_reason == "abort"
        # the other requests, then and now, are served as before
        assert chat(server, False) == answers["chat"]
    finally:
        heal(server.engine)
    server.wait_idle()
    assert server.engine.stats()["num_running"] == 0 and not server.engine.is_dead
    assert client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6).choices[0].finish_reason
    assert complete(server, True) == answers["completions"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_too_many_top_logprobs_is_a_400_and_the_next_answer_is_unchanged(server, stream):
    client = server.client()

    def respond(**fields):
        response = client.responses.create(model=server.model, input="Say something", max_output_tokens=6,
                                           temperature=0, stream=stream, **fields)
        if not stream:
            return response.output_text
        return "".join(event.delta for event in response if event.type == "response.output_text.delta")

    before = respond()
    with pytest.raises(openai.BadRequestError) as info:
        respond(top_logprobs=21)
    assert info.value.body["param"] == "logprobs" and "21" in info.value.body["message"]
    assert respond() == before
