"""`llmplug serve` as a process: the API key from the environment, and SIGTERM lets in-flight requests finish."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from llmplug.entrypoints.cli import build_parser

from .conftest import free_port


def test_serve_flags_parse():
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "my-model", "--port", "9000", "--api-key", "a", "--api-key", "b",
                              "--rate-limit", "5/s", "--max-num-seqs", "8"])
    assert args.command == "serve" and args.port == 9000 and args.api_key == ["a", "b"]
    assert getattr(args, "model.model") == "my-model" and args.rate_limit == "5/s"


def health(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def wait_until_healthy(port: int, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"llmplug serve exited early:\n{process.stdout.read()}")
        try:
            if health(port) == 200:
                return
        except OSError:  # not listening yet
            pass
        time.sleep(0.2)
    raise AssertionError("llmplug serve did not become healthy")


def test_sigterm_lets_in_flight_requests_finish_then_exits(tiny_chat_model):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "LLMPLUG_API_KEY": "env-key"}
    process = subprocess.Popen(
        [sys.executable, "-m", "llmplug.entrypoints.cli", "serve", str(tiny_chat_model), "--dtype", "float32",
         "--port", str(port), "--shutdown-timeout", "60", "--served-model-name", "tiny", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_until_healthy(port, process)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="env-key", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]

        started, result = threading.Event(), {}

        def long_stream() -> None:
            stream = client.completions.create(model="tiny", prompt="hi", max_tokens=120, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                started.set()
            result["chunks"] = chunks

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(60)
        process.send_signal(signal.SIGTERM)
        thread.join(120)
        chunks = result["chunks"]
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
        assert process.wait(60) == 0
        with pytest.raises(ConnectionRefusedError):  # no longer accepting
            health(port)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serving_keeps_the_startup_heap_out_of_the_collector_and_unfreezes_after():
    """A full collection while serving walks only what serving made (api_server._startup_heap_frozen)."""
    import gc
    import weakref

    from llmplug.entrypoints.openai.api_server import _startup_heap_frozen

    assert gc.get_freeze_count() == 0
    with _startup_heap_frozen():
        assert gc.get_freeze_count() > 10_000  # this process's imported code and objects
        cycle = Cycle()  # garbage that serving makes is still collected
        cycle.me, gone = cycle, weakref.ref(cycle)
        del cycle
        gc.collect()
        assert gone() is None
    assert gc.get_freeze_count() == 0


class Cycle:
    me: object
