"""Disaggregated prefill/decode through `llmplug proxy`'s app: a kv_producer and a kv_consumer server sharing a
disk_offload directory, the real `openai` client talking to the proxy. Answers equal one engine's (greedy), the
decode engine loads the prompt's blocks instead of computing them, a bad body is refused by the prefill engine
without reaching the decode engine, and the next request is fine."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest
import uvicorn

from llmplug import AsyncLLM
from llmplug.entrypoints.disagg_proxy import build_proxy_app, prefill_body
from .conftest import ENGINE_KWARGS, free_port, serve

PROMPT = "The history of the city began in the year of the great flood, when the river left its bed and " * 2


@pytest.fixture(scope="module")
def servers(tiny_chat_model, tmp_path_factory) -> Iterator[tuple[str, AsyncLLM, AsyncLLM]]:
    """The proxy's URL and the two engines behind it."""
    shared = {"kv_connector": "disk_offload", "kv_offloading_path": str(tmp_path_factory.mktemp("kv"))}
    prefill = AsyncLLM(str(tiny_chat_model), **ENGINE_KWARGS, kv_transfer_config={**shared, "kv_role": "kv_producer"})
    decode = AsyncLLM(str(tiny_chat_model), **ENGINE_KWARGS, kv_transfer_config={**shared, "kv_role": "kv_consumer"})
    try:
        with serve(prefill) as prefill_server, serve(decode) as decode_server:
            port = free_port()
            app = build_proxy_app(prefill_server.base_url, decode_server.base_url, timeout_s=60)
            proxy = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
            thread = threading.Thread(target=proxy.run, daemon=True)
            thread.start()
            deadline = time.monotonic() + 30
            while not proxy.started:
                assert time.monotonic() < deadline and thread.is_alive(), "the proxy did not start"
                time.sleep(0.01)
            try:
                yield f"http://127.0.0.1:{port}", prefill, decode
            finally:
                proxy.should_exit = True
                thread.join(10)
    finally:
        decode.shutdown()
        prefill.shutdown()


@pytest.fixture(scope="module")
def client(servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{servers[0]}/v1", api_key="unused", max_retries=0)


def test_the_prefill_body_asks_one_whole_token() -> None:
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}, "n": 3,
            "max_completion_tokens": 50, "temperature": 0}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "stream": False, "n": 1, "temperature": 0}


def test_completions_equal_one_engine_and_the_decode_engine_loads_the_prompt(client, offline_llm) -> None:
    from llmplug import SamplingParams

    expected = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    reply = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=12,
                                      temperature=0)
    assert reply.choices[0].text == expected.outputs[0].text
    prompt_tokens = len(expected.prompt_token_ids)
    # every full block of the prompt but the one holding its last token came from the prefill engine's files
    assert reply.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16 > 0

    streamed = client.completions.create(model=reply.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == expected.outputs[0].text


def test_chat_streams_through_the_decode_engine(client, offline_llm) -> None:
    from llmplug import SamplingParams

    messages = [{"role": "user", "content": PROMPT}]
    expected = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.outputs[0].text


def test_a_bad_body_is_the_prefill_engines_400_and_the_next_request_works(client, servers) -> None:
    _, _, decode = servers
    model = client.models.list().data[0].id
    before = decode.stats()["prefix_cache_queries"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=model, prompt="hi", max_tokens=4, temperature=-3)
    assert decode.stats()["prefix_cache_queries"] == before  # nothing was scheduled there
    assert client.completions.create(model=model, prompt="hi", max_tokens=4, temperature=0).choices[0].text
