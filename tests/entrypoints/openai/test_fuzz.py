"""Schemathesis fuzzes the server through its own OpenAPI schema (valid and invalid bodies) on the real default
model: no 5xx answer or in-stream error other than a deliberate 503 (the waiting queue is full), and afterwards
the server is healthy and answers a normal request as it did before."""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.core.transport import Response

from .conftest import DEFAULT_MODEL_LEN

pytestmark = pytest.mark.slow

MAX_TOKENS = 4  # generated tokens per completion while fuzzing: the run stays short on 2 CPU cores
MAX_SEQUENCES = 4  # n and best_of
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
ROUTE_LENGTH_FIELD = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
                      "/v1/responses": "max_output_tokens"}
GENERATION = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses")]
TOKENIZATION = [("POST", "/tokenize"), ("POST", "/detokenize")]
# multipart forms (a file and fields): valid ones only (schemathesis derives no invalid form from their schema); the
# default model is no Whisper, so they are refused by name
AUDIO = [("POST", "/v1/audio/transcriptions"), ("POST", "/v1/audio/translations")]
OTHERS = [("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("GET", "/health"), ("GET", "/version"),
          ("GET", "/metrics")]
# (method, path, mode, examples): valid and invalid bodies of the generation routes, where the input is; the
# GET routes take no body (nothing to make invalid), so only valid requests, and a few
CASES = [(m, p, mode, 40) for m, p in GENERATION for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
CASES += [(m, p, mode, 20) for m, p in TOKENIZATION for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
CASES += [(m, p, GenerationMode.POSITIVE, 10) for m, p in AUDIO + OTHERS]


@pytest.fixture(scope="module")
def baseline(default_server) -> str:
    """The greedy answer of a quiet server, before any fuzzing."""
    return greedy_answer(default_server)


@pytest.fixture(scope="module")
def api_schema(default_server, baseline):
    """The server's own OpenAPI schema (loaded after the baseline answer, so fuzzing comes second)."""
    return schemathesis.openapi.from_url(f"{default_server.base_url}/openapi.json")


def operations(api_schema) -> set[tuple[str, str]]:
    return {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}


def greedy_answer(server) -> str:
    reply = server.client().chat.completions.create(model=server.model, messages=QUESTION, temperature=0,
                                                    max_tokens=12)
    return reply.choices[0].message.content


def keep_short(path: str, body: object) -> None:
    """Cap what a valid body may generate (n, best_of, and token counts that fit the context; a body without
    one gets the route's field set, as chat and responses would otherwise fill the whole context), so that the
    run spends its time on many requests rather than long ones. Out-of-range values are left to be refused."""
    if not isinstance(body, dict) or path not in ROUTE_LENGTH_FIELD:  # /tokenize, /detokenize generate nothing
        return
    for field in LENGTH_FIELDS:
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value <= DEFAULT_MODEL_LEN:
            body[field] = MAX_TOKENS
    if all(body.get(field) is None for field in LENGTH_FIELDS):
        body[ROUTE_LENGTH_FIELD[path]] = MAX_TOKENS
    for field in ("n", "best_of"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_SEQUENCES < value <= 128:
            body[field] = MAX_SEQUENCES


def deliberate_overload(response: Response) -> bool:
    """503 from admission control (with Retry-After), not from a dead engine."""
    if response.status_code != 503 or "retry-after" not in response.headers:
        return False
    return response.json()["error"]["code"] == "server_overloaded"


def stream_errors(response: Response) -> list[dict]:
    """The error events of a server-sent-events answer."""
    if not any(value.startswith("text/event-stream") for value in response.headers.get("content-type", [])):
        return []
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: {")]
    return [event["error"] for event in map(json.loads, events) if "error" in event]


def test_every_operation_of_the_schema_is_fuzzed(api_schema):
    assert operations(api_schema) == set(GENERATION + TOKENIZATION + AUDIO + OTHERS)


@pytest.mark.parametrize("method,path,mode,examples", CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode, _ in CASES])
def test_fuzzed_requests_never_get_a_server_error(api_schema, default_server, method, path, mode, examples):
    @given(case=api_schema[path][method].as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              phases=[Phase.generate])  # no shrinking: each example is a real request, the first failure says enough
    def fuzz(case) -> None:
        keep_short(path, case.body)
        response = case.call(timeout=120)
        sent = json.dumps(case.body, default=repr)  # the whole body: a failure must be reproducible from the log
        assert response.status_code < 500 or deliberate_overload(response), f"{sent}\n-> {response.text[:500]}"
        for error in stream_errors(response):
            assert error["type"] != "server_error" and error.get("code") != "engine_dead", f"{sent}\n-> {error}"

    fuzz()


def test_after_fuzzing_the_server_is_healthy_and_answers_as_before(default_server, baseline):
    assert requests.get(f"{default_server.base_url}/health", timeout=10).status_code == 200
    assert not default_server.engine.is_dead
    default_server.wait_idle()
    kv = default_server.engine.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks  # every request's blocks came back
    assert greedy_answer(default_server) == baseline
