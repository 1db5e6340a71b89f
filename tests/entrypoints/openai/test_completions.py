"""/v1/completions and /v1/models through the real openai client: answers equal offline `LLM.generate`."""

from __future__ import annotations

import math

from llmplug import SamplingParams

PROMPT = "The capital of France is"


def offline_generate(llm, prompts, **params):
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def test_models_lists_the_served_model(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.model]
    assert server.client().models.retrieve(server.model).id == server.model


def test_greedy_completion_equals_offline(server, offline):
    expected = offline_generate(offline, [PROMPT], temperature=0.0, max_tokens=10)[0]
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=10)
    assert reply.choices[0].text == expected.outputs[0].text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == 10


def test_default_max_tokens_is_16(server):
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16


def test_batch_of_prompts_and_token_ids_with_n2(server, offline):
    token_prompt = offline.get_tokenizer().encode("Once upon a time")
    expected = offline_generate(offline, [PROMPT, {"prompt_token_ids": token_prompt}], temperature=1.0, seed=11,
                                n=2, max_tokens=6)
    reply = server.client().completions.create(model=server.model, prompt=[PROMPT], temperature=1.0, seed=11,
                                               n=2, max_tokens=6)
    reply_ids = server.client().completions.create(model=server.model, prompt=token_prompt, temperature=1.0,
                                                   seed=11, n=2, max_tokens=6)
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [o.text for o in expected[0].outputs]
    assert [c.text for c in sorted(reply_ids.choices, key=lambda c: c.index)] == [o.text for o in expected[1].outputs]
    both = server.client().completions.create(model=server.model, prompt=[PROMPT, PROMPT], temperature=0,
                                              max_tokens=4, n=2)
    assert sorted(c.index for c in both.choices) == [0, 1, 2, 3]


def test_streamed_completion_equals_offline(server, offline):
    expected = offline_generate(offline, [PROMPT], temperature=0.7, seed=5, max_tokens=12)[0]
    stream = server.client().completions.create(model=server.model, prompt=PROMPT, temperature=0.7, seed=5,
                                                max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 12


def test_logprobs_and_offsets(server, offline):
    expected = offline_generate(offline, [PROMPT], temperature=0.0, max_tokens=5, logprobs=2)[0].outputs[0]
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=5,
                                               logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == 5
    for got, token_id, position in zip(logprobs.token_logprobs, expected.token_ids, expected.logprobs):
        assert math.isclose(got, position[token_id].logprob, abs_tol=1e-4)
    assert all(len(top) == 2 for top in logprobs.top_logprobs if top is not None)
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    assert logprobs.text_offset == offsets
    assert "".join(logprobs.tokens) == reply.choices[0].text


def test_stop_string_and_echo(server, offline):
    free = offline_generate(offline, [PROMPT], temperature=0.0, max_tokens=12)[0].outputs[0].text
    stop = free[4:7]
    expected = offline_generate(offline, [PROMPT], temperature=0.0, max_tokens=12, stop=stop)[0].outputs[0]
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, temperature=0, max_tokens=12,
                                               stop=stop, echo=True)
    assert reply.choices[0].text == PROMPT + expected.text
    assert reply.choices[0].finish_reason == "stop"
