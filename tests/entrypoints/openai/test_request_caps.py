"""Every size a request controls has a cap, checked before any work per item: past it, a 400 naming the
field, the cap and its flag, while the server keeps answering others; the next good request is served."""

from __future__ import annotations

import threading
import time

import pytest

from llmplug.entrypoints.openai.admission import AdmissionControl
from llmplug.entrypoints.openai.errors import OpenAIError

from .liveness import watching
from .test_cross_encoder import DOCS, QUERY, cross_encoder, cross_server  # noqa: F401 - fixtures
from .test_errors import post

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
MESSAGES = [{"role": "user", "content": "hi"}]

# name -> (path, body beyond model, the flag the 400 names)
OVER_CAPS = {
    "prompts": ("/v1/completions", {"prompt": ["a"] * 257, "max_tokens": 1}, "--max-prompts"),
    "allowed_token_ids": ("/v1/completions", {"prompt": "a", "allowed_token_ids": [5] * 8193},
                          "--max-allowed-token-ids"),
    "bad_words": ("/v1/completions", {"prompt": "a", "bad_words": [f"w{i}" for i in range(129)]}, "--max-bad-words"),
    "bad word length": ("/v1/completions", {"prompt": "a", "bad_words": ["z" * 257]}, "--max-bad-word-length"),
    "tools": ("/v1/chat/completions", {"messages": MESSAGES, "tools": [TOOL] * 129}, "--max-tools"),
    "tool schemas": ("/v1/chat/completions", {"messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "description": "d" * 70000}}}
    ]}, "--max-constraint-chars"),
    "regex": ("/v1/completions", {"prompt": "a", "guided_regex": "a" * 65537}, "--max-constraint-chars"),
    "response_format schema": ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "description": "d" * 70000}}}},
        "--max-constraint-chars"),
    "responses tools": ("/v1/responses", {"input": "hi", "tools": [
        {"type": "function", "name": f"f{i}", "parameters": {"type": "object"}} for i in range(129)]}, "--max-tools"),
}


@pytest.mark.parametrize("name", list(OVER_CAPS))
def test_a_request_past_a_cap_is_a_400_naming_it_and_the_next_is_served(server, name):
    path, body, flag = OVER_CAPS[name]
    status, reply, _ = post(server, path, {"model": server.model, **body})
    assert status == 400, reply
    assert flag in reply["error"]["message"], reply
    good = server.client().completions.create(model=server.model, prompt="a", max_tokens=3)
    assert good.choices[0].finish_reason == "length"


def test_at_the_caps_requests_are_served(server):
    status, reply, _ = post(server, "/v1/completions", {"model": server.model, "prompt": "a", "max_tokens": 2,
                                                        "bad_words": ["z" * 256] * 2, "allowed_token_ids": [5] * 8192})
    assert status == 200, reply


def test_rerank_of_70000_documents_is_refused_before_any_is_tokenized(cross_server):
    def small_rerank() -> None:
        status, reply, _ = post(cross_server, "/rerank", {"query": QUERY, "documents": DOCS[:2]})
        assert status == 200, reply

    with watching(cross_server, small_rerank):
        time.sleep(1.0)
        start = time.monotonic()
        status, reply, _ = post(cross_server, "/rerank", {"query": QUERY, "documents": ["a document"] * 70000})
        refused_after = time.monotonic() - start
        status_score, reply_score, _ = post(cross_server, "/v1/score", {"text_1": QUERY, "text_2": ["d"] * 2049})
        time.sleep(2.5)
    assert status == 400 and "--max-pooling-inputs" in reply["error"]["message"], reply
    assert status_score == 400 and "--max-pooling-inputs" in reply_score["error"]["message"], reply_score
    assert refused_after < 2.0, f"refused after {refused_after:.2f} s"
    small_rerank()


def test_admission_counts_every_sequence_a_request_creates():
    admission = AdmissionControl(4, lambda: 0)
    with admission.admit(6):  # an empty queue takes one request of any (capped) size
        assert admission.in_flight == 6
        with pytest.raises(OpenAIError) as error:
            with admission.admit(1):
                pass
        assert error.value.status == 503
    with admission.admit(3):
        with pytest.raises(OpenAIError):
            with admission.admit(2):  # 3 waiting + 2 do not fit in 4
                pass
        with admission.admit(1):
            assert admission.in_flight == 4
    assert admission.in_flight == 0


def test_bad_words_are_tokenized_off_the_engine_thread_once(server, monkeypatch):
    processor = server.engine.llm_engine.processor
    threads, tokenize = [], processor._bad_words_token_ids

    def spy(words):
        threads.append(threading.current_thread().name)
        return tokenize(words)

    monkeypatch.setattr(processor, "_bad_words_token_ids", spy)
    words = ["zebra", "quartz lamp"]
    for _ in range(2):
        status, reply, _ = post(server, "/v1/completions", {"model": server.model, "prompt": "a", "max_tokens": 3,
                                                            "bad_words": words})
        assert status == 200, reply
    assert len(threads) == 1 and threads[0] != "llmplug-engine", threads  # cached for the second request
