"""Declared request fields that this server would accept and then ignore are 400s naming them (issue 39: never
silently ignored); the same fields with a value that does take effect (or none) are served."""

from __future__ import annotations

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"messages": QUESTION, "max_tokens": 2}
COMPLETION = {"prompt": "Hello there", "max_tokens": 2}
RESPONSES = {"input": "Hello there", "max_output_tokens": 2}

REFUSED = [
    ("/v1/responses", {**RESPONSES, "store": True}, "store"),
    ("/v1/chat/completions", {**CHAT, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ("/v1/completions", {**COMPLETION, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json_object": False}}, "structured_outputs"),
]
SERVED = [
    ("/v1/responses", {**RESPONSES, "store": False}),
    ("/v1/completions", {**COMPLETION, "guided_decoding_backend": "outlines", "guided_regex": "[ab]{2}"}),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": ["yes", "no"], "disable_any_whitespace": True}}),
]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("path,body,param", REFUSED, ids=[f"{p} {param}" for p, _, param in REFUSED])
def test_a_field_that_would_be_ignored_is_a_400_naming_it(server, path, body, param):
    answer = post(server, path, body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and param in error["message"], error


@pytest.mark.parametrize("path,body", SERVED, ids=[p for p, _ in SERVED])
def test_the_same_fields_where_they_take_effect_are_served(server, path, body):
    answer = post(server, path, body)
    assert answer.status_code == 200, answer.text
