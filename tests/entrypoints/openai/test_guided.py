"""Structured output through the server with the real openai client: response_format and vLLM's guided_* fields."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "A color as JSON."}]


def test_response_format_json_schema_returns_valid_json(server):
    client = server.client()
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"


def test_guided_extras_on_completions_and_responses(server):
    client = server.client()
    completion = client.completions.create(model=server.model, prompt="Pick:", max_tokens=10, temperature=1.0,
                                           extra_body={"guided_choice": ["yes", "no"]})
    assert completion.choices[0].text in ("yes", "no")
    regex = r"[0-9]{3}-[a-z]{2}"
    completion = client.completions.create(model=server.model, prompt="Code:", max_tokens=10, temperature=1.0,
                                           extra_body={"guided_regex": regex, "guided_decoding_backend": "outlines"})
    assert re.fullmatch(regex, completion.choices[0].text)
    response = client.responses.create(model=server.model, input="A color as JSON.", max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "c", "schema": SCHEMA}})
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


@pytest.mark.parametrize("extra, named", [
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
     "not a valid JSON schema at properties/a/type"),
    ({"guided_regex": "(unclosed"}, "guided_decoding regex"),
    ({"guided_grammar": 'start: "a"', "guided_decoding_backend": "outlines"}, "grammar (Lark) is not supported"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one structured-output constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema is required"),
])
def test_bad_constraints_get_a_400_and_the_server_keeps_serving(server, extra, named):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=server.model, prompt="x", max_tokens=5, extra_body=extra)
    assert named in str(error.value)
    assert error.value.status_code == 400
    ok = client.completions.create(model=server.model, prompt="x", max_tokens=3, extra_body={"guided_choice": ["a"]})
    assert ok.choices[0].text == "a"
