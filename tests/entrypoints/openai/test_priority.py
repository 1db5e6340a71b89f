"""vLLM's `priority` request field over HTTP: under scheduler.policy "priority" it reaches the engine and orders
the waiting requests (lower first); under "fcfs" a non-zero one is a 400 naming it, never silently ignored."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # the HTTP client the openai package is built on
import pytest

from llmplug import AsyncLLM

from .conftest import ENGINE_KWARGS, hold_engine_step, serve

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ROUTES = {
    "/v1/completions": {"prompt": "Hello there", "max_tokens": 2},
    "/v1/chat/completions": {"messages": QUESTION, "max_tokens": 2},
    "/v1/responses": {"input": "Hello there", "max_output_tokens": 2},
}


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


@pytest.fixture(scope="module")
def priority_server(tiny_chat_model):
    """A server whose engine schedules by priority and runs one sequence at a time (so requests wait)."""
    engine = AsyncLLM(str(tiny_chat_model), scheduling_policy="priority", max_num_seqs=1, **ENGINE_KWARGS)
    try:
        with serve(engine) as running:
            yield running
    finally:
        engine.shutdown()


@pytest.fixture
def added_priorities(priority_server, monkeypatch) -> list[int]:
    """The priority of each request the engine is given, in the order it is given them."""
    seen: list[int] = []
    real_add = priority_server.engine.llm_engine.add_request

    def spy(*args, priority=0, **kwargs):
        seen.append(priority)
        return real_add(*args, priority=priority, **kwargs)

    monkeypatch.setattr(priority_server.engine.llm_engine, "add_request", spy)
    return seen


@pytest.mark.parametrize("path", ROUTES)
def test_under_fcfs_a_nonzero_priority_is_a_400_naming_it(server, path):
    for priority in (5, -1):
        answer = post(server, path, {**ROUTES[path], "priority": priority})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "priority" and "fcfs" in error["message"], error
    assert post(server, path, {**ROUTES[path], "priority": 0}).status_code == 200


def test_priority_is_bounded(server):
    for priority in (2**31, -(2**31) - 1, 1.5, "high"):
        answer = post(server, "/v1/completions", {**ROUTES["/v1/completions"], "priority": priority})
        assert answer.status_code == 400, (priority, answer.text)
        assert answer.json()["error"]["param"] == "priority"


@pytest.mark.parametrize("path", ROUTES)
def test_priority_reaches_the_engine(priority_server, added_priorities, path):
    for priority in (-3, 0, 2**31 - 1):
        answer = post(priority_server, path, {**ROUTES[path], "priority": priority})
        assert answer.status_code == 200, answer.text
    assert added_priorities == [-3, 0, 2**31 - 1]


def test_beam_search_refuses_a_priority(priority_server):
    body = {**ROUTES["/v1/completions"], "use_beam_search": True, "n": 2, "temperature": 0, "priority": 1}
    answer = post(priority_server, "/v1/completions", body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "priority"


def test_a_later_request_with_a_lower_priority_value_is_served_first(priority_server, added_priorities,
                                                                     monkeypatch):
    """One sequence runs at a time; while a long request runs (its step held), a priority 10 request arrives, then
    a priority -10 one. When the long one ends, the -10 request runs first, though it came second."""
    held, release = hold_engine_step(priority_server, monkeypatch)
    finished: dict[int, float] = {}

    def complete(priority: int, max_tokens: int) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "priority": priority}
        answer = post(priority_server, "/v1/completions", body)
        assert answer.status_code == 200, answer.text
        finished[priority] = time.monotonic()

    with ThreadPoolExecutor(3) as pool:
        blocker = pool.submit(complete, 0, 30)
        assert held.wait(30)
        later = [pool.submit(complete, 10, 20)]
        time.sleep(0.3)  # in the engine's command queue, behind the held step, in this order
        later.append(pool.submit(complete, -10, 20))
        time.sleep(0.3)
        release.set()
        for future in [blocker, *later]:
            future.result(60)
    assert added_priorities == [0, 10, -10]  # the arrival order
    assert finished[0] < finished[-10] < finished[10]  # the service order
