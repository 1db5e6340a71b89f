"""Slow readers: a streaming client that stops reading is dropped and its request aborted, and the outputs
waiting for a slow consumer are merged instead of queued one per step."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from collections import Counter

from llmplug.core.outputs import CompletionOutput, RequestOutput
from llmplug.engine.request_stream import RequestStream
from llmplug.entrypoints.openai.api_server import ServerSettings

from .conftest import serve
from .liveness import watching
from .test_streaming import metrics, wait_for


def delta(index: int, text: str, token_ids: list[int], finish_reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(index=index, text=text, token_ids=token_ids, finish_reason=finish_reason,
                                  logprobs=[{t: None} for t in token_ids])
    return RequestOutput("r", None, [1], [completion], finished=finish_reason is not None)


def test_outputs_for_a_slow_consumer_are_merged_not_queued():
    async def run() -> None:
        stream = RequestStream("r", asyncio.get_running_loop(), delta=True)
        for step in range(1000):  # a consumer that reads nothing while 1000 steps run
            stream.put(delta(step % 2, f"t{step} ", [step]))
        stream.put(delta(1, "", [], finish_reason="length"))
        assert len(stream) == 1
        merged = await stream.get()
        assert [c.index for c in merged.outputs] == [0, 1] and merged.finished
        assert merged.outputs[0].token_ids == list(range(0, 1000, 2))
        assert merged.outputs[1].text == "".join(f"t{s} " for s in range(1, 1000, 2))
        assert len(merged.outputs[1].logprobs) == 500 and merged.outputs[1].finish_reason == "length"
        assert merged.outputs[0].finish_reason is None
        error = RuntimeError("engine died")
        stream.put(delta(0, "a", [1]))
        stream.put(error)  # an error ends the stream: queued behind, never merged
        assert len(stream) == 2 and (await stream.get()).outputs[0].text == "a" and await stream.get() is error

        cumulative = RequestStream("r", asyncio.get_running_loop(), delta=False)
        for step in range(1, 100):
            cumulative.put(delta(0, "x" * step, list(range(step))))
        assert len(cumulative) == 1 and (await cumulative.get()).outputs[0].text == "x" * 99  # the newest holds all

    asyncio.run(run())


def timed_completion(server, seconds: float) -> None:
    """A 4-token completion that must answer within `seconds`."""
    start = time.monotonic()
    reply = server.client(timeout=30).completions.create(model=server.model, prompt="hi", max_tokens=4)
    assert reply.choices[0].finish_reason == "length"
    assert time.monotonic() - start < seconds, f"a 4-token completion took {time.monotonic() - start:.1f} s"


def health_seconds(server) -> float:
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    return time.monotonic() - start


def slow_reader(port: int, body: dict) -> socket.socket:
    """A raw client that sends a streaming request and then reads nothing (a small receive buffer, so the
    server's writes back up soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


def test_a_client_that_stops_reading_is_aborted_and_frees_its_slots(engine):
    """64 sequences of a stream nobody reads hold every admission slot (the limit is 64): once the send
    timeout drops the client, they are aborted, their KV blocks freed, and the next request is admitted."""
    settings = ServerSettings(stream_send_timeout=0.5, max_waiting_requests=64)
    with serve(engine, settings) as server:
        server.wait_idle()
        aborted = metrics(server)["llmplug_requests_total{outcome=abort}"]
        # ~1 KB an event (20 logprobs), 15 MB in all: the socket buffers (up to 4 MB here) fill long before
        # the end (measured on the 2-core machine: dropped after ~7 s of a 25 s generation; with no send
        # timeout the stream waited to the end, then its 64 slots stayed taken and the next request got 503)
        body = {"model": server.model, "prompt": "hi", "max_tokens": 240, "n": 64, "stream": True,
                "ignore_eos": True, "logprobs": 20, "temperature": 1.0}
        sock = slow_reader(server.port, body)
        try:
            wait_for(lambda: server.engine.stats()["num_running"] == 64)  # its 64 slots no longer wait
            with watching(server):  # /health within 1 s, a 4-token completion every 2 s within 5 s, meanwhile
                wait_for(lambda: metrics(server)["llmplug_requests_total{outcome=abort}"] == aborted + 1,
                         timeout=60)
            server.wait_idle()  # no running sequence, no KV block left
            assert health_seconds(server) < 1.0
            timed_completion(server, 5.0)  # admitted: the 64 slots were freed (a leak would make it a 503)
        finally:
            sock.close()


async def chat_clients(server, stop: threading.Event, seen: Counter) -> None:
    """Six clients that read whole greedy streams and three that leave each stream after two chunks, until `stop`."""
    client = server.async_client(timeout=60)

    async def reader() -> None:
        while not stop.is_set():
            stream = await client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0,
                stream=True)
            seen["answered"] += bool([chunk async for chunk in stream])

    async def leaver() -> None:
        while not stop.is_set():
            stream = await client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=64, stream=True,
                extra_body={"ignore_eos": True})
            chunks = 0
            async for _ in stream:
                chunks += 1
                if chunks == 2:
                    break
            await stream.close()
            seen["left"] += 1

    try:
        await asyncio.gather(*[reader() for _ in range(6)], *[leaver() for _ in range(3)])
    finally:
        await client.close()


def test_slow_readers_among_other_clients_leave_no_block_and_no_slot_held(engine, caplog):
    """A small soak: slow readers come one after another while other clients read their streams or leave them;
    afterwards no KV block and no admission slot is held, and no request got a 5xx."""
    with serve(engine, ServerSettings(stream_send_timeout=0.5)) as server, \
            caplog.at_level(logging.WARNING, logger="llmplug.entrypoints.openai.backpressure"):
        server.wait_idle()
        before, stop, seen = metrics(server), threading.Event(), Counter()
        clients = threading.Thread(target=lambda: asyncio.run(chat_clients(server, stop, seen)))
        clients.start()
        body = {"model": server.model, "prompt": "hi", "max_tokens": 240, "n": 64, "stream": True,
                "ignore_eos": True, "logprobs": 20, "temperature": 1.0}
        try:
            for dropped in (1, 2):
                sock = slow_reader(server.port, body)
                try:
                    wait_for(lambda: sum("read nothing" in r.getMessage() for r in caplog.records) == dropped,
                             timeout=90)
                finally:
                    sock.close()
        finally:
            stop.set()
            clients.join(120)
        assert seen["answered"] > 0 and seen["left"] > 0, seen
        server.wait_idle()
        kv = engine.llm_engine.engine_core.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks  # no leaked KV block
        assert server.app.state.admission.in_flight == 0  # no admission slot held
        after = metrics(server)
        assert not [k for k, v in after.items() if "status=5" in k and v > before.get(k, 0.0)]
        timed_completion(server, 5.0)
