"""Fixtures of the server tests: a tiny Llama with SmolLM2's real tokenizer, and real uvicorn servers on 127.0.0.1.

The engines and servers are package-scoped: every user is in this package, and each holds its model and KV cache,
so they end with it rather than with the session (the rest of the suite ran beside them, issue 34).

Every server runs in a thread of the test process (its own event loop), so tests can also look at the
engine behind it. The engine's forward pass keeps per-step state in a module global, so an offline
`LLM` must only run while the server's engine is idle: `offline()` waits for that.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import uvicorn
from fastapi import FastAPI

from llmplug import LLM, AsyncLLM
from llmplug.entrypoints.openai.api_server import ServerSettings, build_app
from llmplug.loaders.default_model import resolve_model_path
from llmplug.loaders.gguf import load_gguf_tokenizer
from tests.models.tiny_models import save_tiny_llama

ENGINE_KWARGS = {"dtype": "float32", "max_model_len": 256, "block_size": 16}
DEFAULT_MODEL_LEN = 256  # of the default-model server: prompts and answers of the fuzz and soak tests fit


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The tokenizer of the embedded SmolLM2 (real vocabulary and chat template)."""
    return load_gguf_tokenizer(resolve_model_path("SmolLM2-135M-Instruct"))


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm_tokenizer) -> Path:
    """A tiny random Llama (hidden 64, 2 layers) with SmolLM2's vocabulary, saved with its tokenizer."""
    path = tmp_path_factory.mktemp("tiny_chat")
    tok = smollm_tokenizer
    save_tiny_llama(path, tok, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    return path


@dataclass
class RunningServer:
    """A real uvicorn server in a thread, serving `engine`."""

    engine: AsyncLLM
    base_url: str
    port: int
    model: str
    app: FastAPI  # what tests look into: app.state.admission, ...

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def async_client(self, api_key: str = "none", **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the engine runs no request and holds no KV block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if is_idle(self.engine):
                return
            time.sleep(0.02)
        raise AssertionError(f"engine still busy after {timeout} s: {self.engine.stats()}")


def hold_engine_step(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Hold the server's engine after its next step until `release` is set (`held` tells the step ran): whatever
    a test sends meanwhile waits in the engine's command queue behind a request that surely runs."""
    held, release = threading.Event(), threading.Event()
    real_step = server.engine.llm_engine.step

    def held_step():
        outputs = real_step()
        if not release.is_set():
            held.set()
            release.wait(30)
        return outputs

    monkeypatch.setattr(server.engine.llm_engine, "step", held_step)
    return held, release


def is_idle(engine: AsyncLLM) -> bool:
    stats = engine.stats()
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


@contextlib.contextmanager
def serve(engine: AsyncLLM, settings: ServerSettings | None = None) -> Iterator[RunningServer]:
    """Run the app for `engine` on a free port of 127.0.0.1 until the block ends."""
    settings = settings or ServerSettings()
    settings.port = free_port()
    app = build_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(engine, f"http://127.0.0.1:{settings.port}", settings.port, app.state.model_names[0], app)
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="package")
def engine(tiny_chat_model) -> Iterator[AsyncLLM]:
    """One AsyncLLM on the tiny chat model, shared by the servers of the package."""
    eng = AsyncLLM(str(tiny_chat_model), **ENGINE_KWARGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="package")
def server(engine) -> Iterator[RunningServer]:
    """A server with default settings (no API key, no rate limit)."""
    with serve(engine) as running:
        yield running


@pytest.fixture(scope="package")
def embeds_server(tiny_chat_model) -> Iterator[RunningServer]:
    """A server whose engine takes prompt embeddings (--enable-prompt-embeds), on the tiny chat model."""
    engine = AsyncLLM(str(tiny_chat_model), **ENGINE_KWARGS, enable_prompt_embeds=True)
    try:
        with serve(engine) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.fixture(scope="package")
def default_server() -> Iterator[RunningServer]:
    """A server on the real default model (SmolLM2-135M-Instruct, GGUF), shared by the fuzz and soak tests.

    float32: in bfloat16 a step's matmuls round differently with the size of the batch, so a near-tie
    between two tokens can flip with the load; the soak test compares greedy answers under load with quiet ones.
    """
    engine = AsyncLLM(max_model_len=DEFAULT_MODEL_LEN, dtype="float32")
    try:
        with serve(engine) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.fixture(scope="package")
def offline_llm(tiny_chat_model) -> LLM:
    """The offline engine on the same model: the reference the server's answers must equal."""
    return LLM(str(tiny_chat_model), **ENGINE_KWARGS)


@pytest.fixture
def offline(offline_llm, server):
    """`offline_llm`, handed out once the server's engine is idle (the two must not step at once)."""
    server.wait_idle()
    return offline_llm
