"""The JSON schema that forces calls (tool_choice "required") and the readers of forced answers, checked
with jsonschema and on fixed outputs streamed in pieces cut everywhere."""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmplug.entrypoints.openai.tools import NamedCallParser, RequiredCallsParser, required_calls_schema
from tests.tool_parsers.test_tool_parsers import TOOLS, splits, streamed

REF_TOOL = {"name": "pick", "parameters": {"type": "object", "properties": {"item": {"$ref": "#/$defs/item"}},
                                           "required": ["item"], "$defs": {"item": {"enum": ["a", "b"]}}}}


def test_required_schema_accepts_valid_call_arrays_and_only_those():
    schema = required_calls_schema([*TOOLS, REF_TOOL], parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, {"name": "now", "parameters": {}},
            {"name": "pick", "parameters": {"item": "a"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {"days": 2}}],
                [{"name": "pick", "parameters": {"item": "c"}}], [{"name": "now"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, required_calls_schema(TOOLS, parallel=False))


def test_forced_answers_are_read_into_calls_whole_and_streamed():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    expected = [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert [(c.name, c.arguments) for c in RequiredCallsParser(TOOLS).extract(text).tool_calls] == expected
    named = NamedCallParser("get_weather")
    assert [(c.name, c.arguments) for c in named.extract('{"city": "Oslo"}').tool_calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    for pieces in splits(text):
        assert streamed(RequiredCallsParser(TOOLS), pieces) == ("", expected)
    for pieces in splits('{"city": "Oslo"}'):
        assert streamed(named, pieces) == ("", [("get_weather", '{"city": "Oslo"}')])


def test_a_forced_answer_cut_short_comes_back_as_content():
    cut = '[{"name": "get_weather", "parameters": {"city": "Pa'
    extracted = RequiredCallsParser(TOOLS).extract(cut)
    assert extracted.content == cut and extracted.tool_calls == []
    assert json.loads(NamedCallParser("now").extract("{}").tool_calls[0].arguments) == {}


def test_a_forced_calls_arguments_are_scanned_once_as_they_stream(monkeypatch):
    from llmplug.plugins.tool_parsers import base

    visited, scan = [0], base.JsonScan._bracketed_end

    def counting_scan(self, text):
        visited[0] += len(text) - self.pos
        return scan(self, text)

    monkeypatch.setattr(base.JsonScan, "_bracketed_end", counting_scan)
    arguments = '{"city": "' + "x" * 2000 + '"}'
    stream, sent = NamedCallParser("get_weather").stream(), ""
    for i in range(0, len(arguments), 2):
        for call in stream.feed(arguments[i:i + 2]).tool_calls:
            sent += call.arguments
    assert sent == arguments
    assert visited[0] < 2 * len(arguments)  # scanned from the start at every delta: ~len^2 / 4


def test_required_calls_are_scanned_once_as_they_stream(monkeypatch):
    from llmplug.plugins.tool_parsers import base

    visited, scan = [0], base.JsonScan._bracketed_end

    def counting_scan(self, text):
        visited[0] += len(text) - self.pos
        return scan(self, text)

    monkeypatch.setattr(base.JsonScan, "_bracketed_end", counting_scan)
    calls = [{"name": "get_weather", "parameters": {"city": "x" * 500}} for _ in range(4)]
    text = json.dumps(calls)
    got_content, got_calls = streamed(RequiredCallsParser(TOOLS), [text[i:i + 3] for i in range(0, len(text), 3)])
    assert got_content == "" and [json.loads(a) for _, a in got_calls] == [c["parameters"] for c in calls]
    assert visited[0] < 2 * len(text)  # scanned from each call's start at every delta: ~len^2 / 6
