"""Bad input gets the right status and OpenAI's error body, and the server keeps serving everyone else."""

from __future__ import annotations

import http.client
import json
import threading

import openai
import pytest

CHAT = "/v1/chat/completions"
GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


def post(server, path: str, body: bytes | str | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    """Raw POST (no client-side validation); returns status, JSON body and headers."""
    payload = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=payload, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null"), dict(response.getheaders())
    finally:
        conn.close()


def assert_openai_error(body: dict, status: int) -> dict:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else error["type"])
    return error


TOO_LONG = "word " * 400  # far more than the 256-token context

BAD_REQUESTS = {
    "malformed json": (CHAT, '{"messages": [', 400, None),
    "not an object": (CHAT, "[1, 2]", 400, None),
    "missing messages": (CHAT, {"model": "x"}, 400, "messages"),
    "messages wrong type": (CHAT, {"messages": "hello"}, 400, "messages"),
    "temperature wrong type": (CHAT, {**GOOD_CHAT, "temperature": "hot"}, 400, "temperature"),
    "n wrong type": (CHAT, {**GOOD_CHAT, "n": [2]}, 400, "n"),
    "negative max_tokens": (CHAT, {**GOOD_CHAT, "max_tokens": -5}, 400, "max_tokens"),
    "huge max_tokens": (CHAT, {**GOOD_CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    "huge max_completion_tokens": (CHAT, {**GOOD_CHAT, "max_tokens": None, "max_completion_tokens": 5000}, 400,
                                   "max_completion_tokens"),
    "prompt longer than context": (CHAT, {**GOOD_CHAT, "messages": [{"role": "user", "content": TOO_LONG}]}, 400,
                                   "messages"),
    "top_p out of range": (CHAT, {**GOOD_CHAT, "top_p": 1.5}, 400, "top_p"),
    "subnormal repetition_penalty": (CHAT, {**GOOD_CHAT, "repetition_penalty": 5e-324}, 400, "repetition_penalty"),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    "image content": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                      400, "messages[0].content"),
    "bad logit_bias": (CHAT, {**GOOD_CHAT, "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    "unknown model": (CHAT, {**GOOD_CHAT, "model": "gpt-17"}, 404, "model"),
    "completion prompt too long": ("/v1/completions", {"prompt": TOO_LONG}, 400, "prompt"),
    "completion empty prompt": ("/v1/completions", {"prompt": []}, 400, "prompt"),
    "completion token out of vocab": ("/v1/completions", {"prompt": [10**9]}, 400, None),
    "completion negative max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    "responses huge max_output_tokens": ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}, 400,
                                         "max_output_tokens"),
    "responses previous id": ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400,
                              "previous_response_id"),
    "unknown route": ("/v1/nothing", {}, 404, None),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_request_gets_status_and_openai_error_body(server, name):
    path, body, status, param = BAD_REQUESTS[name]
    got_status, got_body, _ = post(server, path, body)
    assert got_status == status, got_body
    error = assert_openai_error(got_body, status)
    if param is not None:
        assert error["param"] == param
    if name == "unknown model":
        assert error["code"] == "model_not_found"
    if "long" in name or "huge" in name:
        assert error["code"] == "context_length_exceeded"


def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=-1)
    assert info.value.status_code == 400 and "max_tokens" in str(info.value)
    with pytest.raises(openai.BadRequestError):  # streaming too: the error comes before the stream starts
        client.completions.create(model=server.model, prompt=[10**9], stream=True)


def test_bad_requests_do_not_disturb_a_running_stream(server, offline):
    from llmplug import SamplingParams

    expected = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].text
    result = {}

    def stream() -> None:
        chunks = server.client().completions.create(model=server.model, prompt="Once upon a time", temperature=0,
                                                    max_tokens=40, stream=True, extra_body={"ignore_eos": True})
        result["text"] = "".join(c.choices[0].text for c in chunks if c.choices)

    thread = threading.Thread(target=stream)
    thread.start()
    for name in sorted(BAD_REQUESTS):
        path, body, status, _ = BAD_REQUESTS[name]
        assert post(server, path, body)[0] == status
    thread.join(60)
    assert result["text"] == expected
    server.wait_idle()
    good = server.client().chat.completions.create(model=server.model, **GOOD_CHAT)
    assert good.choices[0].finish_reason in ("length", "stop")


def test_health_version_metrics(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for path, content in (("/health", b""), ("/version", b'"version"'), ("/metrics", b"llmplug_requests_total")):
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        assert response.status == 200 and content in body, (path, body[:200])
    conn.close()
