"""vLLM's `structured_outputs` request field through the real openai client: valid output per kind, one
constraint per request (400 otherwise), and structural tags where a backend has them."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["S", "M", "L"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["size", "count"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
MESSAGES = [{"role": "user", "content": "Give me a date."}]


@pytest.mark.parametrize("seed", range(3))
def test_regex_choice_and_json_give_valid_output(server, seed):
    client = server.client()

    def ask(structured: dict) -> str:
        reply = client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=1.0, seed=seed,
                                               max_tokens=40, extra_body={"structured_outputs": structured})
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    assert re.fullmatch(DATE, ask({"regex": DATE}))
    assert ask({"choice": ["cat", "dog", "emu"]}) in ("cat", "dog", "emu")
    jsonschema.validate(json.loads(ask({"json": SCHEMA})), SCHEMA)
    completion = client.completions.create(model=server.model, prompt="Date:", max_tokens=20, temperature=1.0,
                                           seed=seed, extra_body={"structured_outputs": {"regex": DATE}})
    assert re.fullmatch(DATE, completion.choices[0].text)


def test_structural_tag_on_a_backend_that_has_it(server):
    tag = {"type": "structural_tag", "triggers": ["<f>"],
           "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}]}
    client = server.client()
    reply = client.completions.create(model=server.model, prompt="Hi", max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)},
                                                  "guided_decoding_backend": "xgrammar"})
    assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=server.model, prompt="Hi", max_tokens=8,
                                  extra_body={"structured_outputs": {"structural_tag": tag},
                                              "guided_decoding_backend": "outlines"})
    assert "structural_tag is not supported by the outlines backend; backends that can: xgrammar" in str(error.value)


@pytest.mark.parametrize("extra, named", [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.regex, structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex, structured_outputs.regex"),
    ({"structured_outputs": {"json": SCHEMA}, "response_format": {"type": "json_object"}},
     "structured_outputs.json, response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"structured_outputs": {"choice": []}}, "choice must be a non-empty list"),
])
def test_conflicting_or_bad_constraints_get_a_400_and_the_server_keeps_serving(server, extra, named):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert named in str(error.value)
    ok = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=5,
                                        extra_body={"structured_outputs": {"choice": ["ok"]}})
    assert ok.choices[0].message.content == "ok"
