"""/v1/completions' `prompt_embeds` (vLLM's: base64 of a torch.save'd tensor) through the real openai client: the
tokens' embeddings answer as the tokens do offline; off without --enable-prompt-embeds; bad payloads are 400s
naming what is wrong, and the next request works."""

from __future__ import annotations

import base64
import io
import os

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from llmplug import SamplingParams

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0, max_tokens=10, extra_body={"ignore_eos": True})


def b64(value) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def hf_model(tiny_chat_model):
    return AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()


def embeds_of(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model.get_input_embeddings()(torch.tensor(ids)).clone()


@pytest.fixture
def reference(offline_llm, embeds_server):
    """The offline engine, once the server's engine is idle (the two must not step at once)."""
    embeds_server.wait_idle()
    return offline_llm


def offline_texts(llm, prompts) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_embeddings_of_the_tokens_answer_as_the_tokens_do_offline(embeds_server, reference, hf_model):
    ids = reference.get_tokenizer().encode(PROMPT)
    [expected] = offline_texts(reference, [{"prompt_token_ids": ids}])
    client = embeds_server.client()
    # the openai client needs a prompt: "" beside prompt_embeds is none (as vLLM's example sends it)
    reply = client.completions.create(model=embeds_server.model, prompt="",
                                      **{**GREEDY, "extra_body": {**GREEDY["extra_body"],
                                                                  "prompt_embeds": b64(embeds_of(hf_model, ids))}})
    assert [c.text for c in reply.choices] == [expected]
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 10
    stream = client.completions.create(model=embeds_server.model, prompt="", stream=True,
                                       **{**GREEDY, "extra_body": {**GREEDY["extra_body"],
                                                                   "prompt_embeds": b64(embeds_of(hf_model, ids))}})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected


def test_a_list_of_embeddings_and_text_prompts_answers_embeddings_first(embeds_server, reference, hf_model):
    tokenizer = reference.get_tokenizer()
    texts = ["Once upon a time", "Hello"]
    ids = [tokenizer.encode(t) for t in texts]
    expected = offline_texts(reference, [{"prompt_token_ids": i} for i in [*ids, tokenizer.encode(PROMPT)]])
    reply = embeds_server.client().completions.create(
        model=embeds_server.model, prompt=PROMPT,
        **{**GREEDY, "extra_body": {**GREEDY["extra_body"],
                                    "prompt_embeds": [b64(embeds_of(hf_model, i)) for i in ids]}},
    )
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected


def test_off_without_the_flag_names_it(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="--enable-prompt-embeds") as error:
        client.completions.create(model=server.model, prompt="", max_tokens=2,
                                  extra_body={"prompt_embeds": b64(torch.zeros(3, 64))})
    assert error.value.body["param"] == "prompt_embeds"
    assert client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2).choices


class _Evil:
    def __reduce__(self):
        return os.system, ("echo pwned",)


@pytest.mark.parametrize("payload, message", [
    ("not base64!", "is not valid base64"),
    (base64.b64encode(b"just some bytes").decode(), "is not a tensor saved with torch.save"),
    (b64(_Evil()), "is not a tensor saved with torch.save"),  # weights_only: no code runs
    (b64({"embeds": torch.zeros(3, 64)}), "must be a torch.Tensor, got dict"),
    (b64(torch.zeros(3, 65)), "must be [num_tokens, 64]"),
    (b64(torch.zeros(3, 64, dtype=torch.int32)), "float dtype"),
    (b64(torch.full((3, 64), float("nan"))), "NaN or infinite"),
    (b64(torch.zeros(300, 64)), "has 300 rows"),
    (b64(torch.zeros(3, 64).to_sparse()), "must be a dense tensor"),
], ids=["base64", "bytes", "pickle", "dict", "width", "int", "nan", "rows", "sparse"])
def test_bad_payloads_are_400s_and_the_next_request_works(embeds_server, hf_model, payload, message):
    client = embeds_server.client()
    with pytest.raises(openai.BadRequestError, match="prompt_embeds") as error:
        client.completions.create(model=embeds_server.model, prompt="", max_tokens=2,
                                  extra_body={"prompt_embeds": payload})
    assert message in error.value.body["message"] and error.value.body["param"] == "prompt_embeds"
    reply = client.completions.create(model=embeds_server.model, prompt="", max_tokens=2,
                                      extra_body={"prompt_embeds": b64(embeds_of(hf_model, [1, 2, 3]))})
    assert len(reply.choices) == 1


def test_echo_needs_prompt_text_and_a_completion_needs_some_prompt(embeds_server, hf_model):
    client = embeds_server.client()
    payload = b64(embeds_of(hf_model, [1, 2, 3]))
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=embeds_server.model, prompt="", max_tokens=2, echo=True,
                                  extra_body={"prompt_embeds": payload})
    with pytest.raises(openai.BadRequestError, match="prompt or prompt_embeds"):
        embeds_server.client().post("/completions", cast_to=object, body={"model": embeds_server.model})
