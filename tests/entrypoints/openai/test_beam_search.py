"""`use_beam_search` on /v1/completions and /v1/chat/completions through the real openai client: the choices
are offline `LLM.beam_search`'s beams."""

from __future__ import annotations

import openai
import pytest

from llmplug import BeamSearchParams

PROMPT = "The capital of France is"


def offline_beams(llm, prompt, **params) -> list[str]:
    output = llm.beam_search(prompt, BeamSearchParams(**params))[0]
    tokenizer = llm.get_tokenizer()
    prompt_len = len(prompt["prompt_token_ids"])
    return [tokenizer.decode(s.tokens[prompt_len:], skip_special_tokens=True) for s in output.sequences]


def test_completion_beams_equal_offline(server, offline):
    prompt = {"prompt_token_ids": offline.get_tokenizer().encode(PROMPT)}
    expected = offline_beams(offline, prompt, beam_width=3, max_tokens=6, length_penalty=0.5)
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, n=3, max_tokens=6,
                                               extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    server.wait_idle()


def test_chat_beams_equal_offline_streamed_too(server, offline):
    messages = [{"role": "user", "content": "Say hi"}]
    prompt = offline.chat_prompt(messages)
    expected = offline_beams(offline, {"prompt_token_ids": prompt["prompt_token_ids"]}, beam_width=2, max_tokens=5)
    client = server.client()
    reply = client.chat.completions.create(model=server.model, messages=messages, n=2, max_tokens=5,
                                           extra_body={"use_beam_search": True})
    assert [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)] == expected
    texts = ["", ""]
    for chunk in client.chat.completions.create(model=server.model, messages=messages, n=2, max_tokens=5,
                                                stream=True, extra_body={"use_beam_search": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == expected
    server.wait_idle()


@pytest.mark.parametrize("fields,extra_body,param", [
    ({"stop": ["x"]}, {}, "stop"),
    ({"logprobs": 2}, {}, "logprobs"),
    ({"n": 30}, {}, "beam_width"),  # 60 logprobs per beam > decoding.max_logprobs
    ({}, {"length_penalty": 1e9}, "length_penalty"),
    # sampling fields beam search would ignore
    ({"top_p": 0.5}, {}, "top_p"),
    ({"seed": 1, "temperature": 0.5}, {}, "seed"),
    ({"frequency_penalty": 0.5}, {"top_k": 5}, "top_k"),
    ({}, {"repetition_penalty": 1.2}, "repetition_penalty"),
    ({}, {"skip_special_tokens": False}, "skip_special_tokens"),
])
def test_bad_beam_search_requests_are_400_and_the_next_works(server, offline, fields, extra_body, param):
    client = server.client()
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "n": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body, extra_body={"use_beam_search": True, **extra_body})
    assert param in str(info.value)
    prompt = {"prompt_token_ids": offline.get_tokenizer().encode(PROMPT)}
    expected = offline_beams(offline, prompt, beam_width=2, max_tokens=4)
    reply = client.completions.create(model=server.model, prompt=PROMPT, n=2, max_tokens=4,
                                      extra_body={"use_beam_search": True})
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected
    server.wait_idle()
