"""POST /tokenize and /detokenize (vLLM's shapes) on a real server, checked against transformers' own tokenizer
of the model folder: its `encode`, `convert_ids_to_tokens`, `decode` and `apply_chat_template`."""

from __future__ import annotations

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest
from transformers import AutoTokenizer

from llmplug.entrypoints.openai.api_server import ServerSettings

from .conftest import ENGINE_KWARGS, serve

TEXTS = ["Hello, world!", "  two  spaces\nand a newline", "café, naïve, 日本語 and an emoji 🙂", ""]
MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_chat_model):
    """transformers' tokenizer of the served folder: the reference."""
    return AutoTokenizer.from_pretrained(tiny_chat_model)


def post(server, path: str, body: dict, api_key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)


def chat_template_ids(tokenizer, messages, **kwargs) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 answers a BatchEncoding


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_then_detokenize_equals_the_tokenizer(server, hf_tokenizer, text):
    answer = post(server, "/tokenize", {"prompt": text})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = hf_tokenizer.encode(text)
    assert body == {"count": len(expected), "max_model_len": ENGINE_KWARGS["max_model_len"], "tokens": expected,
                    "token_strs": None}
    back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": hf_tokenizer.decode(expected)}
    assert back.json()["prompt"] == text


def test_add_special_tokens_and_token_strs(server, hf_tokenizer):
    text = "Hello, world!"
    body = post(server, "/tokenize", {"model": server.model, "prompt": text, "add_special_tokens": False,
                                      "return_token_strs": True}).json()
    assert body["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(body["tokens"])
    special = [hf_tokenizer.bos_token_id, *body["tokens"], hf_tokenizer.eos_token_id]
    assert post(server, "/detokenize", {"tokens": special}).json()["prompt"] == hf_tokenizer.decode(special)


def test_chat_form_equals_apply_chat_template(server, hf_tokenizer):
    cases = [
        ({}, {"add_generation_prompt": True}),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        ({"add_generation_prompt": False, "continue_final_message": True}, {"continue_final_message": True}),
    ]
    for request, template_kwargs in cases:
        body = post(server, "/tokenize", {"messages": MESSAGES, **request, "return_token_strs": True}).json()
        expected = chat_template_ids(hf_tokenizer, MESSAGES, **template_kwargs)
        assert body["tokens"] == expected, request
        assert body["count"] == len(expected) and body["max_model_len"] == ENGINE_KWARGS["max_model_len"]
        assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    with_bos = post(server, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True}).json()["tokens"]
    text = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert with_bos == hf_tokenizer.encode(text, add_special_tokens=True)


def test_chat_form_counts_what_the_chat_endpoint_charges(server):
    """The chat form renders through the chat endpoint's own path: its count is the chat request's prompt_tokens;
    with tools the template gets them too (a chat request with tools is served)."""
    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    for extra in ({}, {"tools": tools}):
        count = post(server, "/tokenize", {"messages": MESSAGES, **extra}).json()["count"]
        choice = {"tool_choice": "required"} if extra else {}  # "auto" needs --enable-auto-tool-choice here
        chat = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **extra, **choice})
        assert chat.status_code == 200, chat.text
        if not extra:
            assert chat.json()["usage"]["prompt_tokens"] == count
    # with tools the template gets them (or the fallback system text): the prompt is longer
    assert post(server, "/tokenize", {"messages": MESSAGES, "tools": tools}).json()["count"] > \
        post(server, "/tokenize", {"messages": MESSAGES}).json()["count"]


def test_bad_requests_are_400s_naming_the_field_then_a_good_one_works(server, hf_tokenizer):
    vocab = len(hf_tokenizer)
    answer = post(server, "/detokenize", {"tokens": [1, vocab, 2, -5]})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "tokens" and str(vocab) in error["message"] and "-5" in error["message"]
    for body, param in [
        ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"messages": []}, "messages"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
    ]:
        answer = post(server, "/tokenize", body)
        assert answer.status_code == 400, (body, answer.text)
        assert param in (answer.json()["error"]["param"] or ""), (body, answer.json())
    unknown = post(server, "/tokenize", {"model": "no-such-model", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert post(server, "/detokenize", {"tokens": [1, 2, 3]}).json()["prompt"] == hf_tokenizer.decode([1, 2, 3])


def test_tokenize_needs_the_api_key(engine):
    with serve(engine, ServerSettings(api_keys=["key-a"])) as guarded:
        for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
            assert post(guarded, path, body).status_code == 401
            assert post(guarded, path, body, api_key="wrong").status_code == 401
            assert post(guarded, path, body, api_key="key-a").status_code == 200
