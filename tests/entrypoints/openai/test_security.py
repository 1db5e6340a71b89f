"""API keys, rate limits, CORS and the body size limit of a real server."""

from __future__ import annotations

import http.client
import json
import logging
import re

import openai
import pytest

from llmplug.core.errors import ConfigError
from llmplug.entrypoints.openai.api_server import ServerSettings, build_app
from llmplug.entrypoints.openai.loggable import loggable
from llmplug.entrypoints.openai.security import OPEN_PATHS, RateLimit, TokenBuckets, default_allowed_hosts, host_name

from .conftest import serve


@pytest.fixture(scope="module")
def guarded(engine):
    """Two API keys, CORS for one origin, 2 KiB bodies."""
    settings = ServerSettings(api_keys=["key-a", "key-b"], allowed_origins=["https://app.example"],
                              max_body_bytes=2048)
    with serve(engine, settings) as running:
        yield running


def request(server, method: str, path: str, *, body: bytes | None = None, headers: dict | None = None,
            source: str = "127.0.0.1") -> tuple[int, bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30, source_address=(source, 0))
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def test_missing_or_wrong_api_key_gets_401(guarded):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic key-a"},
                    {"Authorization": "Bearer key-a-but-longer"}):
        status, body, got = request(guarded, "GET", "/v1/models", headers=headers)
        assert status == 401
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        assert got["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").models.list()


def leaf_routes(routes: list) -> list:
    """The routes in `routes`, those of included routers too (FastAPI keeps an included router as one entry
    that holds the router; no prefixes are used)."""
    leaves = []
    for route in routes:
        inner = getattr(route, "original_router", None)
        leaves += leaf_routes(inner.routes) if inner is not None else [route]
    return leaves


def route_calls(app) -> list[tuple[str, str]]:
    """(method, path) of every route of `app`, path parameters filled in."""
    calls = []
    for route in leaf_routes(app.routes):
        path = re.sub(r"\{[^}]+\}", "some-id", route.path)
        calls += [(method, path) for method in sorted(getattr(route, "methods", None) or ["GET"])]
    return calls


def test_every_route_but_the_open_ones_needs_the_key(engine):
    """Walks the app's own routes, so a route added later is checked without anyone listing it here."""
    settings = ServerSettings(api_keys=["key-a"], allow_runtime_lora_updating=True)
    calls = route_calls(build_app(engine, settings))
    paths = {path for _, path in calls}
    assert OPEN_PATHS <= paths and {"/score", "/rerank", "/v2/rerank", "/classify", "/pooling"} <= paths
    assert len(calls) >= 20, calls
    with serve(engine, settings) as running:
        for method, path in calls:
            json_body = {"Content-Type": "application/json"}
            for key in (None, "wrong"):
                headers = {**json_body, **({"Authorization": f"Bearer {key}"} if key else {})}
                status = request(running, method, path, body=b"{}" if method == "POST" else None, headers=headers)[0]
                assert status == (200 if path in OPEN_PATHS else 401), (method, path, key, status)
            status = request(running, method, path, body=b"{}" if method == "POST" else None,
                             headers={**json_body, "Authorization": "Bearer key-a"})[0]
            assert status not in (401, 403) and status < 500, (method, path, status)
        reply = running.client(api_key="key-a").completions.create(model=running.model, prompt="hi", max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")


def test_either_key_works_and_open_routes_need_none(guarded):
    assert guarded.client(api_key="key-a").models.list().data[0].id == guarded.model
    reply = guarded.client(api_key="key-b").chat.completions.create(
        model=guarded.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].message.role == "assistant"
    for path in ("/health", "/version", "/metrics"):
        assert request(guarded, "GET", path)[0] == 200


def test_over_the_rate_limit_gets_429_and_others_are_unaffected(engine):
    settings = ServerSettings(api_keys=["key-a", "key-b"], rate_limit=RateLimit.parse("3/min"))
    with serve(engine, settings) as running:
        greedy = running.client(api_key="key-a")
        assert [len(greedy.models.list().data) for _ in range(3)] == [1, 1, 1]  # the burst
        with pytest.raises(openai.RateLimitError) as info:
            greedy.models.list()
        assert 1 <= int(info.value.response.headers["retry-after"]) <= 20
        assert info.value.response.json()["error"]["code"] == "rate_limit_exceeded"
        other = running.client(api_key="key-b")  # another key has its own budget
        reply = other.chat.completions.create(model=running.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert request(running, "GET", "/health")[0] == 200  # the open routes are not limited


def test_rate_limit_without_keys_is_per_client_address(engine):
    with serve(engine, ServerSettings(rate_limit=RateLimit.parse("2/min"))) as running:
        assert [request(running, "GET", "/v1/models")[0] for _ in range(3)] == [200, 200, 429]
        status, _, headers = request(running, "GET", "/v1/models")
        assert status == 429 and 1 <= int(headers["retry-after"]) <= 30
        assert request(running, "GET", "/v1/models", source="127.0.0.2")[0] == 200  # another client
        for path in ("/score", "/v2/rerank", "/pooling", "/openapi.json"):  # every route counts, not only /v1
            assert request(running, "POST" if path != "/openapi.json" else "GET", path, body=b"{}")[0] == 429, path
        assert request(running, "GET", "/health")[0] == 200  # the open routes are not limited


def test_body_over_the_limit_gets_413(guarded):
    body = json.dumps({"prompt": "x" * 4000}).encode()
    headers = {"Authorization": "Bearer key-b", "Content-Type": "application/json"}
    status, raw, _ = request(guarded, "POST", "/v1/completions", body=body, headers=headers)
    assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
    assert guarded.client(api_key="key-b").models.list().data


def test_cors_only_for_configured_origins(guarded, server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, _, headers = request(guarded, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
    status, _, headers = request(guarded, "OPTIONS", "/v1/chat/completions",
                                 headers={**preflight, "Origin": "https://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in headers
    _, _, headers = request(server, "GET", "/v1/models", headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in headers  # CORS is off by default


def test_rate_limit_parsing_and_buckets():
    assert RateLimit.parse("10/s") == RateLimit(10, 1.0)
    assert RateLimit.parse("600/min").per_second == 10
    for bad in ("10", "ten/s", "10/day", "0/s"):
        with pytest.raises(ConfigError):
            RateLimit.parse(bad)
    now = [0.0]
    buckets = TokenBuckets(RateLimit(2, 1.0), clock=lambda: now[0])
    assert [buckets.acquire("a"), buckets.acquire("a")] == [0.0, 0.0]
    assert buckets.acquire("a") == pytest.approx(0.5)
    assert buckets.acquire("b") == 0.0
    now[0] = 0.5
    assert buckets.acquire("a") == 0.0



@pytest.mark.parametrize("framing", [("Content-Length", "2000"), ("Transfer-Encoding", "chunked")])
def test_the_api_key_is_checked_before_the_body_is_read(guarded, framing):
    """No body is ever sent: a server that read it before checking the key would wait for it, never answer 401."""
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        for name, value in (("Authorization", "Bearer wrong"), ("Content-Type", "application/json"), framing):
            conn.putheader(name, value)
        conn.endheaders()  # the headers only
        response = conn.getresponse()
        assert response.status == 401
        assert json.loads(response.read())["error"]["code"] == "invalid_api_key"
    finally:
        conn.close()
    reply = guarded.client(api_key="key-a").chat.completions.create(
        model=guarded.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_loopback_server_refuses_foreign_host_headers(server):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends `Host: evil.example`."""
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example", ""):
        for path in ("/v1/models", "/health"):
            status, body, _ = request(server, "GET", path, headers={"Host": host})
            assert status == 400 and json.loads(body)["error"]["code"] == "invalid_host", (host, path)
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "LOCALHOST", f"[::1]:{server.port}"):
        assert request(server, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    assert server.client().models.list().data[0].id == server.model


def test_allowed_hosts_flag_replaces_the_default(engine):
    with serve(engine, ServerSettings(allowed_hosts=["api.example"])) as running:
        assert request(running, "GET", "/v1/models", headers={"Host": "api.example:443"})[0] == 200
        assert request(running, "GET", "/v1/models", headers={"Host": "127.0.0.1"})[0] == 400
    with serve(engine, ServerSettings(allowed_hosts=["*"])) as running:
        assert request(running, "GET", "/v1/models", headers={"Host": "anything.example"})[0] == 200
    assert default_allowed_hosts("0.0.0.0") == ["*"] and default_allowed_hosts("192.168.1.5") == ["*"]
    assert "127.0.0.1" in default_allowed_hosts("127.0.0.1") == default_allowed_hosts("localhost")
    assert [host_name(h) for h in ("Api.Example:80", "[::1]:8000", "localhost.", "::1")] == \
        ["api.example", "::1", "localhost", "::1"]


def test_client_text_is_logged_on_one_line_and_cut_short(server, caplog):
    fields = {"forged\nERROR root: the server was hacked": 1, "x" * 100_000: 1,
              **{f"extra_{i}": i for i in range(30)}}
    with caplog.at_level(logging.WARNING, logger="llmplug.entrypoints.openai.serving_engine"):
        reply = server.client().completions.create(model=server.model, prompt="hi", max_tokens=2, extra_body=fields)
    assert reply.choices[0].finish_reason in ("length", "stop")
    [logged] = [r.getMessage() for r in caplog.records if "not known" in r.getMessage()]
    assert "\n" not in logged and "forged\\x0aERROR" in logged
    assert len(logged) < 3000 and "more characters" in logged and "(and 12 more)" in logged
    assert loggable("a\x1b[31mb\u2028c") == "a\\x1b[31mb\\u2028c" and loggable("é" * 5, 3) == "ééé... (2 more characters)"
