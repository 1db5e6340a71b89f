"""vLLM's dev-mode routes (/sleep, /wake_up, /is_sleeping, /reset_prefix_cache) on a real server: off by
default, on with --enable-dev-endpoints or VLLM_SERVER_DEV_MODE=1, behind the API key, and what a client of
the generation routes sees while the engine sleeps."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest

from llmplug import AsyncLLM
from llmplug.entrypoints.cli import build_parser
from llmplug.entrypoints.openai.api_server import ServerSettings

from .conftest import ENGINE_KWARGS, hold_engine_step, serve

KEY = "dev-key"
DEV_ROUTES = [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache")]
PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog wakes up and chases the fox across"


@pytest.fixture(scope="module")
def dev_server(tiny_chat_model):
    """A server with the dev routes and an API key, on an engine of its own (these tests put it to sleep)."""
    engine = AsyncLLM(str(tiny_chat_model), **ENGINE_KWARGS)
    try:
        with serve(engine, ServerSettings(api_keys=[KEY], enable_dev_endpoints=True)) as running:
            yield running
    finally:
        engine.shutdown()


def call(server, method: str, path: str, *, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, f"{server.base_url}{path}", headers=headers, timeout=60, **kwargs)


def complete(server, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, **extra}
    return call(server, "POST", "/v1/completions", json=body)


def is_sleeping(server) -> bool:
    answer = call(server, "GET", "/is_sleeping")
    assert answer.status_code == 200, answer.text
    return answer.json()["is_sleeping"]


def test_dev_routes_are_off_by_default(server):
    for method, path in DEV_ROUTES:
        assert call(server, method, path, key=None).status_code == 404, path


def test_dev_routes_need_the_api_key(dev_server):
    for method, path in DEV_ROUTES:
        assert call(dev_server, method, path, key=None).status_code == 401, path
        assert call(dev_server, method, path, key="wrong").status_code == 401, path
    assert not is_sleeping(dev_server)  # nothing above reached the engine


def test_while_asleep_requests_get_503_and_after_wake_up_the_same_answer(dev_server):
    before = complete(dev_server)
    assert before.status_code == 200, before.text
    assert call(dev_server, "POST", "/sleep", params={"level": 1}).status_code == 200
    try:
        assert is_sleeping(dev_server)
        for answer in (complete(dev_server), complete(dev_server, stream=True),
                       call(dev_server, "POST", "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})):
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert error["code"] == "engine_asleep" and "asleep" in error["message"], error
        # what needs no model still works
        assert call(dev_server, "POST", "/tokenize", json={"prompt": "hi"}).status_code == 200
        again = call(dev_server, "POST", "/sleep")
        assert again.status_code == 409 and "already asleep" in again.json()["error"]["message"]
    finally:
        assert call(dev_server, "POST", "/wake_up").status_code == 200
    assert not is_sleeping(dev_server)
    after = complete(dev_server)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]


def test_wake_up_by_tags_and_bad_arguments(dev_server):
    assert call(dev_server, "POST", "/sleep", params={"level": 3}).status_code == 400
    assert call(dev_server, "POST", "/sleep", params={"level": "deep"}).status_code == 400
    assert call(dev_server, "POST", "/sleep", params={"level": 1}).status_code == 200
    try:
        bad = call(dev_server, "POST", "/wake_up", params={"tags": "brain"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
        assert call(dev_server, "POST", "/wake_up", params={"tags": "weights"}).status_code == 200
        assert is_sleeping(dev_server)  # the KV cache still sleeps
        assert complete(dev_server).status_code == 503
    finally:
        assert call(dev_server, "POST", "/wake_up", params={"tags": ["kv_cache", "weights"]}).status_code == 200
    assert not is_sleeping(dev_server)
    assert complete(dev_server).status_code == 200


def test_reset_prefix_cache_forgets_cached_prompts(dev_server):
    def cached_tokens() -> int:
        answer = complete(dev_server)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached_tokens()
    assert cached_tokens() > 0  # the second time the prompt's full blocks are cached
    assert call(dev_server, "POST", "/reset_prefix_cache").status_code == 200
    assert cached_tokens() == 0


def test_reset_prefix_cache_while_a_request_runs_is_409(dev_server, monkeypatch):
    """The engine's step is held once a long request runs, so the reset arrives while it surely runs."""
    held, release = hold_engine_step(dev_server, monkeypatch)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(complete, dev_server, max_tokens=200, ignore_eos=True)
        assert held.wait(30)
        reset = pool.submit(call, dev_server, "POST", "/reset_prefix_cache")
        time.sleep(0.3)  # the reset waits in the engine's command queue, behind the held step
        release.set()
        answer = reset.result(60)
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["code"] == "engine_state"
        assert running.result(60).status_code == 200
    dev_server.wait_idle()
    assert call(dev_server, "POST", "/reset_prefix_cache").status_code == 200


def test_flag_and_vllm_environment_variable_turn_them_on(monkeypatch):
    parser, _ = build_parser()
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert not ServerSettings.from_args(parser.parse_args(["serve"])).enable_dev_endpoints
    assert ServerSettings.from_args(parser.parse_args(["serve", "--enable-dev-endpoints"])).enable_dev_endpoints
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert ServerSettings.from_args(parser.parse_args(["serve"])).enable_dev_endpoints
