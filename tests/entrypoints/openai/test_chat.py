"""/v1/chat/completions through the real openai client: the server's answers equal offline `LLM.chat`."""

from __future__ import annotations

import math

import pytest

from llmplug import SamplingParams

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


def offline_chat(llm, messages=MESSAGES, **params):
    out = llm.chat(messages, SamplingParams(**params), use_tqdm=False)[0]
    return out


def test_greedy_chat_equals_offline(server, offline):
    expected = offline_chat(offline, temperature=0.0, max_tokens=12)
    reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, temperature=0,
                                                    max_tokens=12)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert reply.object == "chat.completion" and reply.model == server.model and reply.id.startswith("chatcmpl-")
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_equals_offline_and_reports_usage(server, offline):
    expected = offline_chat(offline, temperature=0.0, max_tokens=12)
    stream = server.client().chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, max_completion_tokens=12, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == expected.outputs[0].text
    assert finish == [expected.outputs[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert len({c.id for c in chunks}) == 1


def test_seeded_n2_equals_offline(server, offline):
    expected = offline_chat(offline, temperature=1.0, top_p=0.9, seed=1234, n=2, max_tokens=10)
    reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, temperature=1.0,
                                                    top_p=0.9, seed=1234, n=2, max_tokens=10)
    got = sorted(reply.choices, key=lambda c: c.index)
    assert [c.message.content for c in got] == [o.text for o in expected.outputs]
    assert got[0].message.content != got[1].message.content  # each choice has its own seed


def test_streamed_n2_interleaves_both_choices(server, offline):
    expected = offline_chat(offline, temperature=1.0, seed=7, n=2, max_tokens=8)
    stream = server.client().chat.completions.create(model=server.model, messages=MESSAGES, temperature=1.0,
                                                     seed=7, n=2, max_tokens=8, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [o.text for o in expected.outputs]


def test_logprobs_match_offline(server, offline):
    expected = offline_chat(offline, temperature=0.0, max_tokens=6, logprobs=3)
    reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, temperature=0,
                                                    max_tokens=6, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    completion = expected.outputs[0]
    assert len(content) == len(completion.token_ids)
    for entry, token_id, position in zip(content, completion.token_ids, completion.logprobs):
        assert math.isclose(entry.logprob, position[token_id].logprob, abs_tol=1e-4)
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy: the chosen token is the most likely one
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token


def test_stop_string_ends_the_answer_like_offline(server, offline):
    free = offline_chat(offline, temperature=0.0, max_tokens=16).outputs[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]  # a piece from the middle of the free answer
    expected = offline_chat(offline, temperature=0.0, max_tokens=16, stop=[stop]).outputs[0]
    reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, temperature=0,
                                                    max_tokens=16, stop=[stop])
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "stop"
    assert stop not in reply.choices[0].message.content


@pytest.mark.parametrize("extra", [
    {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3},
    {"presence_penalty": 1.5, "frequency_penalty": 0.5, "min_tokens": 4, "ignore_eos": True},
])
def test_extra_sampling_fields_equal_offline(server, offline, extra):
    expected = offline_chat(offline, temperature=0.8, seed=3, max_tokens=8, **extra)
    reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, temperature=0.8,
                                                    seed=3, max_tokens=8, extra_body=extra)
    assert reply.choices[0].message.content == expected.outputs[0].text


def test_logit_bias_forces_a_token(server, offline_llm):
    tokenizer = offline_llm.get_tokenizer()
    token_id = tokenizer.encode(" banana", add_special_tokens=False)[0]
    reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, temperature=0,
                                                    max_tokens=3, logit_bias={str(token_id): 100})
    assert reply.choices[0].message.content == tokenizer.decode([token_id] * 3)
