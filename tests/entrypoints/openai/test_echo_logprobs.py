"""/v1/completions `echo` (with `logprobs` and `max_tokens: 0`, as evaluation harnesses score) and vLLM's
`prompt_logprobs` on completions and chat: the prompt's logprobs equal transformers' on the same weights."""

from __future__ import annotations

import json

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

PROMPT = "The capital of France is Paris, and the capital of Italy is"
MESSAGES = [{"role": "user", "content": "Name a color."}]
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_chat_model):
    """transformers' own load of the served folder: the independent reference."""
    return AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()


def hf_prompt_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: log-softmax of the next-token logits at each prompt position but the last."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_good_completion_works(server) -> None:
    """The project rule: after a refused request, the next good one is answered."""
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=2, temperature=0,
                                               echo=True, logprobs=1)
    assert reply.choices[0].text.startswith(PROMPT)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/{path}", json={"model": server.model, **body}, timeout=60)


def assert_top_matches(top: dict, expected: torch.Tensor, decode, k: int) -> None:
    """`top` (text -> logprob) holds transformers' k most likely tokens, with their logprobs (ties aside)."""
    values, ids = expected.topk(k + 1)
    assert len(top) == k
    for value, token_id in zip(values[:k].tolist(), ids[:k].tolist()):
        text = decode([token_id])
        if text in top:
            assert top[text] == pytest.approx(value, abs=TOL)
        else:  # a near-tie with the next token may swap them
            assert abs(value - values[k].item()) < TOL


def test_echo_puts_the_prompt_before_the_text(server, offline):
    from llmplug import SamplingParams

    expected = offline.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0,
                                               echo=True)
    assert reply.choices[0].text == PROMPT + expected.outputs[0].text
    assert reply.usage.completion_tokens == 4


def test_echo_of_a_token_id_prompt_is_its_decoded_text(server, smollm_tokenizer):
    ids = smollm_tokenizer.encode(PROMPT)
    reply = server.client().completions.create(model=server.model, prompt=ids, max_tokens=0, echo=True)
    assert reply.choices[0].text == smollm_tokenizer.decode(ids)
    assert reply.choices[0].finish_reason == "length"


def test_echo_logprobs_with_max_tokens_0_equal_transformers(server, hf_model, smollm_tokenizer):
    ids = smollm_tokenizer.encode(PROMPT)
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=0, echo=True,
                                               logprobs=1, temperature=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    decode = smollm_tokenizer.decode
    assert logprobs.tokens == [decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = hf_prompt_logprobs(hf_model, ids)
    for i, token_id in enumerate(ids[1:], start=1):
        assert logprobs.token_logprobs[i] == pytest.approx(expected[i - 1, token_id].item(), abs=TOL)
        assert_top_matches(logprobs.top_logprobs[i], expected[i - 1], decode, 1)
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]
    assert logprobs.text_offset == offsets


def test_echo_logprobs_then_the_generated_tokens(server, offline, hf_model, smollm_tokenizer):
    from llmplug import SamplingParams

    ids = smollm_tokenizer.encode(PROMPT)
    expected = offline.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2),
                                use_tqdm=False)[0].outputs[0]
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=3, echo=True,
                                               logprobs=2, temperature=0)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 3
    reference = hf_prompt_logprobs(hf_model, ids)
    for i, token_id in enumerate(ids[1:], start=1):
        assert logprobs.token_logprobs[i] == pytest.approx(reference[i - 1, token_id].item(), abs=TOL)
        assert_top_matches(logprobs.top_logprobs[i], reference[i - 1], smollm_tokenizer.decode, 2)
    generated = [p[t].logprob for t, p in zip(expected.token_ids, expected.logprobs)]
    assert logprobs.token_logprobs[len(ids):] == pytest.approx(generated, abs=TOL)
    assert logprobs.text_offset[len(ids)] == len(PROMPT)  # the generated text starts after the echoed prompt
    assert reply.choices[0].text == PROMPT + expected.text


def stream_chunks(server, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60,
                      json={"model": server.model, "stream": True, **body}) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_echo_sends_the_prompt_and_its_logprobs_first(server, smollm_tokenizer):
    ids = smollm_tokenizer.encode(PROMPT)
    whole = post(server, "completions", dict(prompt=PROMPT, max_tokens=4, echo=True, logprobs=1,
                                             temperature=0)).json()["choices"][0]
    chunks = stream_chunks(server, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, temperature=0)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) >= len(ids)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == whole["text"]
    streamed = [lp for c in choices if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
    assert streamed[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=TOL)
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def test_streamed_echo_with_max_tokens_0_is_the_prompt_alone(server, smollm_tokenizer):
    chunks = stream_chunks(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                           stream_options={"include_usage": True})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPT
    assert choices[-1]["finish_reason"] == "length"
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert len(tokens) == len(smollm_tokenizer.encode(PROMPT))
    assert chunks[-1]["usage"]["completion_tokens"] == 0


def assert_prompt_logprobs_equal(prompt_logprobs: list, ids: list[int], reference: torch.Tensor, k: int) -> None:
    """vLLM's shape: None first, then per position {token id: {logprob, rank, decoded_token}} holding the prompt
    token and the top k, equal to transformers'."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i, token_id in enumerate(ids[1:], start=1):
        position = {int(key): value for key, value in prompt_logprobs[i].items()}
        assert position[token_id]["logprob"] == pytest.approx(reference[i - 1, token_id].item(), abs=TOL)
        ranked = {value["rank"]: (key, value["logprob"]) for key, value in position.items()}
        values, top_ids = reference[i - 1].topk(k)
        for rank in range(1, k + 1):
            key, logprob = ranked[rank]
            assert logprob == pytest.approx(values[rank - 1].item(), abs=TOL)
            if key != top_ids[rank - 1].item():  # only a near-tie may swap two tokens
                assert reference[i - 1, key].item() == pytest.approx(values[rank - 1].item(), abs=TOL)


def test_prompt_logprobs_on_completions_equal_transformers(server, hf_model, smollm_tokenizer):
    ids = smollm_tokenizer.encode(PROMPT)
    reply = post(server, "completions", dict(prompt=PROMPT, max_tokens=1, prompt_logprobs=3))
    assert reply.status_code == 200
    choice = reply.json()["choices"][0]
    assert choice["text"] and not choice["text"].startswith(PROMPT)  # no echo: prompt_logprobs alone
    assert_prompt_logprobs_equal(choice["prompt_logprobs"], ids, hf_prompt_logprobs(hf_model, ids), 3)


def test_prompt_logprobs_through_the_openai_client(server, smollm_tokenizer):
    reply = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=1,
                                               extra_body={"prompt_logprobs": 0})
    prompt_logprobs = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == len(smollm_tokenizer.encode(PROMPT))
    assert all(len(position) == 1 for position in prompt_logprobs[1:])  # the prompt's token alone


def test_echo_logprobs_and_prompt_logprobs_each_get_their_count(server, smollm_tokenizer):
    choice = post(server, "completions", dict(prompt=PROMPT, max_tokens=0, echo=True, logprobs=3,
                                              prompt_logprobs=1)).json()["choices"][0]
    assert all(len(top) == 3 for top in choice["logprobs"]["top_logprobs"][1:])
    ranks = [sorted(v["rank"] for v in position.values()) for position in choice["prompt_logprobs"][1:]]
    assert all(r[0] == 1 and len(r) <= 2 for r in ranks)  # the top token, and the prompt's own unless it is it


def test_prompt_logprobs_on_chat_equal_transformers(server, hf_model, smollm_tokenizer):
    ids = smollm_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    reply = server.client().chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=2,
                                                    extra_body={"prompt_logprobs": 2})
    assert reply.usage.prompt_tokens == len(ids)
    prompt_logprobs = reply.model_extra["prompt_logprobs"]
    assert_prompt_logprobs_equal(prompt_logprobs, ids, hf_prompt_logprobs(hf_model, ids), 2)


@pytest.mark.parametrize("path,body,param", [
    ("completions", dict(prompt=PROMPT, prompt_logprobs=21), "prompt_logprobs"),  # decoding.max_logprobs is 20
    ("completions", dict(prompt=PROMPT, prompt_logprobs=-1), "prompt_logprobs"),
    ("completions", dict(prompt=PROMPT, echo=True, logprobs=21, max_tokens=0), "logprobs"),
    ("completions", dict(prompt=PROMPT, prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("completions", dict(prompt=PROMPT, max_tokens=0), "max_tokens"),
    ("completions", dict(prompt=PROMPT, max_tokens=-1, echo=True), "max_tokens"),
    ("completions", dict(prompt=PROMPT, stream_options={"include_usage": True}), "stream_options"),
    ("completions", dict(prompt=PROMPT, length_penalty=0.5), "length_penalty"),
    ("completions", dict(prompt=PROMPT, prompt_logprobs=1, n=2, use_beam_search=True), "prompt_logprobs"),
    ("chat/completions", dict(messages=MESSAGES, prompt_logprobs=21), "prompt_logprobs"),
    ("chat/completions", dict(messages=MESSAGES, prompt_logprobs=1, stream=True), "prompt_logprobs"),
    ("chat/completions", dict(messages=MESSAGES, stream_options={"include_usage": True}), "stream_options"),
])
def test_bad_echo_and_prompt_logprobs_requests_are_400_and_the_next_works(server, path, body, param):
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    server.wait_idle()  # refused before anything was queued
    assert_good_completion_works(server)


def test_bounds_errors_through_the_openai_client(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=1,
                                           extra_body={"prompt_logprobs": 1000000})
    assert "prompt_logprobs" in str(info.value)
    assert_good_completion_works(server)


def test_completions_stream_continuous_usage(server):
    chunks = stream_chunks(server, prompt=PROMPT, max_tokens=3, temperature=0,
                           stream_options={"include_usage": True, "continuous_usage_stats": True})
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all(c["usage"] is not None for c in with_choices)
    assert with_choices[-1]["usage"]["completion_tokens"] == 3


def test_streamed_echo_of_n_choices_each_start_with_the_prompt_and_its_logprobs(server, smollm_tokenizer):
    num_prompt_tokens = len(smollm_tokenizer.encode(PROMPT))
    chunks = stream_chunks(server, prompt=[PROMPT, PROMPT + " Rome"], max_tokens=3, echo=True, logprobs=1, n=2,
                           temperature=1.0, seed=3)
    by_index: dict[int, list[dict]] = {}
    for c in chunks:
        for choice in c["choices"]:
            by_index.setdefault(choice["index"], []).append(choice)
    assert sorted(by_index) == [0, 1, 2, 3]
    for index, choices in by_index.items():
        prompt = PROMPT if index < 2 else PROMPT + " Rome"
        assert choices[0]["text"].startswith(prompt)
        token_logprobs = [lp for c in choices if c["logprobs"] for lp in c["logprobs"]["token_logprobs"]]
        assert token_logprobs[0] is None
        assert len(token_logprobs) == num_prompt_tokens + (index >= 2) + 3
        assert all(lp is not None for lp in token_logprobs[1:])
        assert choices[-1]["finish_reason"] is not None


def test_without_a_tokenizer_echo_is_400_and_logprobs_still_work(tiny_chat_model, smollm_tokenizer):
    from llmplug import AsyncLLM
    from tests.entrypoints.openai.conftest import ENGINE_KWARGS, serve

    ids = smollm_tokenizer.encode(PROMPT)
    engine = AsyncLLM(str(tiny_chat_model), skip_tokenizer_init=True, **ENGINE_KWARGS)
    try:
        with serve(engine) as bare:
            refused = post(bare, "completions", dict(prompt=ids, max_tokens=0, echo=True, logprobs=1))
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo"
            reply = post(bare, "completions", dict(prompt=ids, max_tokens=2, logprobs=1, prompt_logprobs=1))
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert len(choice["logprobs"]["token_logprobs"]) == 2
            assert len(choice["prompt_logprobs"]) == len(ids)
    finally:
        engine.shutdown()
