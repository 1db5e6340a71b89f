"""Soak: 64 streaming clients for over a minute on the real default model; a third leave mid-stream, a third send
invalid bodies. Afterwards no KV block is leaked, the engine never died, every invalid body got a 4xx, and every
greedy answer given under load equals the one a quiet server gives."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections import Counter

import openai
import pytest

from .test_streaming import metrics

pytestmark = pytest.mark.slow

NUM_CLIENTS = 64
DURATION_S = 65.0
MAX_TOKENS = 16
QUESTIONS = [f"In one sentence: what is {topic}?" for topic in
             ("the sun", "a river", "bread", "a violin", "the moon", "rain", "a bridge", "chess")]
# (what is wrong, body) for /v1/chat/completions; each must be refused with a 4xx, never hurt anyone else
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
INVALID_BODIES = [
    ("not JSON", b'{"messages": [{"role": "user", "content": "hi"'),
    ("a JSON list", b"[1, 2, 3]"),
    ("no messages", json.dumps({"max_tokens": 4}).encode()),
    ("empty messages", json.dumps({**GOOD, "messages": []}).encode()),
    ("unknown role", json.dumps({**GOOD, "messages": [{"role": "robot", "content": "hi"}]}).encode()),
    ("negative max_tokens", json.dumps({**GOOD, "max_tokens": -5}).encode()),
    ("max_tokens past the context", json.dumps({**GOOD, "max_tokens": 10**6}).encode()),
    ("temperature 7", json.dumps({**GOOD, "temperature": 7}).encode()),
    ("n = 0", json.dumps({**GOOD, "n": 0}).encode()),
    ("unknown model", json.dumps({**GOOD, "model": "no-such-model"}).encode()),
    ("a client chat template", json.dumps({**GOOD, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}).encode()),
    ("stop token id -1", json.dumps({**GOOD, "stop_token_ids": [-1]}).encode()),
    ("logit_bias outside the vocabulary", json.dumps({**GOOD, "logit_bias": {"99999999": 1}}).encode()),
    ("image content", json.dumps({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}).encode()),
    ("a malformed JSON schema", json.dumps({**GOOD, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}).encode()),
]


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


async def answer(client: openai.AsyncOpenAI, model: str, question: str) -> str:
    """A greedy streamed answer, assembled from its chunks."""
    stream = await client.chat.completions.create(model=model, messages=messages(question), temperature=0,
                                                  max_tokens=MAX_TOKENS, stream=True)
    return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])


async def normal_client(client, model: str, deadline: float, rng: random.Random, answers: list) -> None:
    while time.monotonic() < deadline:
        question = rng.choice(QUESTIONS)
        answers.append((question, await answer(client, model, question)))


async def leaving_client(client, model: str, deadline: float, rng: random.Random, left: Counter) -> None:
    while time.monotonic() < deadline:
        stream = await client.chat.completions.create(
            model=model, messages=messages(rng.choice(QUESTIONS)), temperature=0.8, max_tokens=64, stream=True,
            extra_body={"ignore_eos": True})
        wanted = rng.randint(1, 6)
        async for index, _ in aiter_enumerate(stream):
            if index + 1 == wanted:
                break
        await stream.close()  # mid-stream: the server must abort the request and free its blocks
        left["left"] += 1


async def invalid_client(port: int, deadline: float, rng: random.Random, refused: Counter) -> None:
    while time.monotonic() < deadline:
        what, body = rng.choice(INVALID_BODIES)
        status, answer = await post_raw(port, "/v1/chat/completions", body)
        assert 400 <= status < 500, (what, status, answer[:300])
        assert "error" in json.loads(answer), what
        refused[what] += 1


async def post_raw(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    """POST `body` as it is (invalid JSON included) over a fresh HTTP/1.1 connection: (status, response body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + body)
    await writer.drain()
    response = await reader.read()  # the server closes the connection after answering
    writer.close()
    await writer.wait_closed()
    status_line, _, rest = response.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def aiter_enumerate(stream):
    index = itertools.count()
    async for item in stream:
        yield next(index), item


def quiet_answers(server) -> dict[str, str]:
    """Each question's greedy answer, asked alone on an idle server."""

    async def ask_all() -> dict[str, str]:
        client = server.async_client(timeout=120)
        try:
            return {q: await answer(client, server.model, q) for q in QUESTIONS}
        finally:
            await client.close()

    server.wait_idle()
    return asyncio.run(ask_all())


def test_soak_64_clients_leave_no_leak_no_death_and_the_same_greedy_answers(default_server):
    expected = quiet_answers(default_server)
    before = metrics(default_server)
    answers: list[tuple[str, str]] = []
    left, refused = Counter(), Counter()

    async def soak() -> None:
        deadline = time.monotonic() + DURATION_S
        client = default_server.async_client(timeout=300)
        kinds = [normal_client, leaving_client, invalid_client]
        try:
            tasks = []
            for i in range(NUM_CLIENTS):
                rng = random.Random(i)
                kind = kinds[i % 3]
                if kind is normal_client:
                    tasks.append(normal_client(client, default_server.model, deadline, rng, answers))
                elif kind is leaving_client:
                    tasks.append(leaving_client(client, default_server.model, deadline, rng, left))
                else:
                    tasks.append(invalid_client(default_server.port, deadline, rng, refused))
            await asyncio.gather(*tasks)
        finally:
            await client.close()

    started = time.monotonic()
    asyncio.run(soak())
    assert time.monotonic() - started >= 60.0  # the load lasted at least a minute
    engine = default_server.engine
    assert not engine.is_dead  # no engine death
    default_server.wait_idle(timeout=120)
    kv = engine.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # no leaked KV block
    assert set(refused) == {what for what, _ in INVALID_BODIES}  # every kind of invalid body was sent, and refused
    assert left["left"] >= NUM_CLIENTS // 3
    assert len(answers) >= NUM_CLIENTS // 3 and {q for q, _ in answers} == set(QUESTIONS)
    wrong = [(q, text) for q, text in answers if text != expected[q]]
    assert not wrong, f"{len(wrong)} of {len(answers)} greedy answers under load differ from the quiet run: {wrong[:3]}"
    after = metrics(default_server)
    server_errors = {k: v - before.get(k, 0.0) for k, v in after.items()
                     if k.startswith("llmplug_http_responses_total") and "status=5" in k}
    assert all(count == 0 for count in server_errors.values()), server_errors
    assert quiet_answers(default_server) == expected  # and the server answers as before
