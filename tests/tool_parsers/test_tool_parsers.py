"""Each in-tree tool parser on fixed model outputs: whole, and streamed in pieces cut at every place.

Streaming is checked by cutting each output into two pieces at every index, into single characters,
and into seeded random pieces; the deltas must add up to exactly the expected content and calls.
"""

from __future__ import annotations

import json
import random

import pytest

from llmplug.core.plugins import get_registry
from llmplug.plugins.tool_parsers import ToolParser

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                       "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["city"],
    },
}
TOOLS = [WEATHER, {"name": "now", "parameters": {"type": "object", "properties": {}}}]

# parser -> [(output, expected content, expected [(name, arguments)])]
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>', None,
         [("get_weather", {"city": "Paris", "days": 2})]),
        ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "a}b\\"c"}}</tool_call>\n'
         '<tool_call>{"name": "now", "arguments": {}}</tool_call>', "Let me check.\n",
         [("get_weather", {"city": 'a}b"c'}), ("now", {})]),
        ('<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>', None,
         [("get_weather", {"city": "Oslo"})]),
        ("No tools needed: 2 < 3 and <tool is a word.", "No tools needed: 2 < 3 and <tool is a word.", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Rome", "metric": true}}', None,
         [("get_weather", {"city": "Rome", "metric": True})]),
        ('<|python_tag|>{"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Bonn"}}',
         None, [("now", {}), ("get_weather", {"city": "Bonn"})]),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon", "tags": ["a", "b]"]}}, '
         '{"name": "now", "arguments": {}}]', None,
         [("get_weather", {"city": "Lyon", "tags": ["a", "b]"]}), ("now", {})]),
        ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]now[ARGS]{}', "Sure. ",
         [("get_weather", {"city": "Nice"}), ("now", {})]),
        ("Plain [TOOL] text.", "Plain [TOOL] text.", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris, FR", days=3, tags=["x", "y)"]), now()]', None,
         [("get_weather", {"city": "Paris, FR", "days": 3, "tags": ["x", "y)"]}), ("now", {})]),
        ("[get_weather(city='Köln', metric=False)]", None, [("get_weather", {"city": "Köln", "metric": False})]),
        ("It is sunny.", "It is sunny.", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
    ],
    "qwen3_xml": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n"
         "5\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n</tool_call>", None,
         [("get_weather", {"city": "San Francisco", "days": 5, "tags": ["a", "b"]})]),
        ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>\n"
         "</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>", "Checking.\n",
         [("get_weather", {"city": "42"}), ("now", {})]),
        ("No call <tool here.", "No call <tool here.", []),
    ],
}
# outputs with a call marker whose call cannot be read: the whole text comes back as content
MALFORMED = {
    "hermes": ['<tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call>',
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', "<tool_call>not json</tool_call>"],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Rome"}; {"name": ', '<|python_tag|>{"name": 3}'],
    "mistral": ['[TOOL_CALLS][{"name": "now", "arguments": {}', "[TOOL_CALLS]oops"],
    "pythonic": ["[get_weather(city=Paris)]", "[now(), get_weather(city='x'"],
    "qwen3_xml": ["<tool_call>\n<function=now>\n<parameter=x>\n1\n", "<tool_call>\n<oops>\n</tool_call>"],
}
CASE_IDS = [(name, i) for name, cases in CASES.items() for i in range(len(cases))]


def parser(name: str) -> ToolParser:
    """The parser registered under `name` (as the server loads it), for a request with TOOLS."""
    return get_registry().load("llmplug.tool_parsers", name)(TOOLS)


def splits(text: str) -> list[list[str]]:
    """The text cut into two at every index, into characters, and into seeded random pieces."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    rng = random.Random(0)
    for _ in range(20):
        points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    return cuts


def streamed(tool_parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments) calls added up from the deltas of `pieces`; names come first and once."""
    stream, content, calls = tool_parser.stream(), "", []
    for delta in [stream.feed(piece) for piece in pieces] + [stream.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            if call.index == len(calls):
                assert call.name is not None, "a call's first delta carries its name"
                calls.append([call.name, call.arguments])
            else:
                assert call.name is None and call.index < len(calls)
                calls[call.index][1] += call.arguments
    return content, [tuple(call) for call in calls]


@pytest.mark.parametrize("name, i", CASE_IDS)
def test_whole_output_gives_exactly_the_expected_content_and_calls(name, i):
    text, content, calls = CASES[name][i]
    extracted = parser(name).extract(text)
    assert extracted.content == content
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == calls


@pytest.mark.parametrize("name, i", CASE_IDS)
def test_stream_cut_anywhere_adds_up_to_the_whole_output(name, i):
    text, content, calls = CASES[name][i]
    whole = parser(name).extract(text)
    for pieces in splits(text):
        got_content, got_calls = streamed(parser(name), pieces)
        assert got_content == (content or ""), pieces
        assert got_calls == [(c.name, c.arguments) for c in whole.tool_calls], pieces


@pytest.mark.parametrize("name, text", [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_malformed_calls_come_back_as_content(name, text):
    extracted = parser(name).extract(text)
    assert extracted.content == text and extracted.tool_calls == []
    for pieces in splits(text)[:: max(1, len(text) // 10)]:
        streamed(parser(name), pieces)  # streaming it never raises


def test_arguments_stream_before_the_call_is_complete():
    stream = parser("hermes").stream()
    first = stream.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", '{"city": "Pa')]
    assert [d.arguments for d in stream.feed('ris"}}</tool_call>').tool_calls] == ['ris"}']
    stream = parser("qwen3_xml").stream()
    stream.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n")
    assert stream.num_calls == 1 and stream._arguments == ['{"city": "Oslo"']


def _reread(tool_parser: ToolParser, text: str, step: int) -> tuple[int, int]:
    """Stream `text` in pieces of `step` characters: (characters read again from the resume point, summed over
    the deltas; characters the JSON scans visited)."""
    from llmplug.plugins.tool_parsers import base

    visited, reread = [0], [0]
    scan, read = base.JsonScan._bracketed_end, tool_parser.snapshot_after

    def counting_scan(self, text):
        visited[0] += len(text) - self.pos
        return scan(self, text)

    def counting_read(text, final, resume):
        reread[0] += len(text) - resume.pos
        return read(text, final, resume)

    base.JsonScan._bracketed_end = counting_scan
    tool_parser.snapshot_after = counting_read
    try:
        content, calls = streamed(tool_parser, [text[i:i + step] for i in range(0, len(text), step)])
    finally:
        base.JsonScan._bracketed_end = scan
    whole = parser(tool_parser.name).extract(text)
    assert (content or None, calls) == (whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
    return reread[0], visited[0]


@pytest.mark.parametrize("name", ["hermes", "qwen3_xml"])
def test_streamed_content_and_finished_calls_are_read_once(name):
    call = CASES[name][0][0]
    part = "Some words. " * 100 + (call + "\nand then " * 20) * 5 + "the end. " * 100
    once, _ = _reread(parser(name), part, 3)
    twice, _ = _reread(parser(name), part * 2, 3)
    assert twice < 2.5 * once  # linear in the output (read from the start at every delta, it would be 4x)


def test_a_long_call_is_scanned_once_as_it_streams():
    arguments = '{"city": "' + "x" * 2000 + '"}'
    _, visited = _reread(parser("hermes"), '<tool_call>{"name": "get_weather", "arguments": ' + arguments + "}</tool_call>", 2)
    assert visited < 2 * len(arguments)  # read from the call's start at every delta: ~len^2 / 4
