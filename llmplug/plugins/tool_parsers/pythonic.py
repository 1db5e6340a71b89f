"""The `pythonic` tool parser: Llama 3.2 / Llama 4 (and others prompted so) answer calls with a Python list
of calls, `[get_weather(city="Paris", metric=True), now()]`, as the whole output."""

from __future__ import annotations

import ast
import json
from typing import Any

import regex

from llmplug.plugins.partial_text import skip_space
from llmplug.plugins.tool_parsers.base import NotACall, PartialCall, Snapshot, ToolParser, arguments_json

LLMPLUG_PLUGIN_API_VERSION = "1.2"

_CALL_START = regex.compile(r"([A-Za-z_][\w.]*)\(")
_ITEM_SEPARATOR = regex.compile(r"\s*([,\]])")


class PythonicToolParser(ToolParser):
    """An output that starts with `[` is read as a list of calls with keyword arguments (Python literals)."""

    name = "pythonic"
    format_hint = ('To call functions, answer with only a Python list of calls with keyword arguments, such as '
                   '[func_name(param="value", other=2)].')

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_space(text, 0)
        if start == len(text):
            return Snapshot(text if final else "")
        if text[start] != "[":
            return Snapshot(text)
        calls: list[PartialCall] = []
        try:
            _read_calls(text, start + 1, final, calls)
        except NotACall as not_a_call:  # the text from where the calls stop being calls
            return Snapshot(not_a_call.args[0] if calls else text, tuple(calls), malformed=bool(calls))
        return Snapshot("", tuple(calls))


def _read_calls(text: str, pos: int, final: bool, calls: list[PartialCall]) -> None:
    """Append the calls of the list from `pos` (after `[`) to `calls`, the last one possibly open."""
    pos = skip_space(text, pos)
    if text.startswith("]", pos):
        return
    while True:
        head = _CALL_START.match(text, pos, partial=not final)
        if head is None:
            raise NotACall(text[pos:])
        if head.partial:
            return
        items, end = _keyword_arguments(text, head.end(), final)
        calls.append(PartialCall(head[1], arguments_json(items, complete=end is not None), complete=end is not None))
        if end is None:
            return
        separator = _ITEM_SEPARATOR.match(text, end)
        if separator is None:
            if final or text[end:].strip():
                raise NotACall(text[end:])
            return
        if separator[1] == "]":
            return
        pos = skip_space(text, separator.end())


def _keyword_arguments(text: str, pos: int, final: bool) -> tuple[list[tuple[str, Any]], int | None]:
    """The complete keyword arguments of a call from `pos` (after `(`), and the index past its `)` (None while
    it is open): commas and the closing parenthesis count only outside strings and brackets."""
    items: list[tuple[str, Any]] = []
    depth, quote, escaped, segment_start = 0, "", False, pos
    for i in range(pos, len(text)):
        char = text[i]
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char == "," and depth == 0:
            items.append(_keyword(text[segment_start:i]))
            segment_start = i + 1
        elif char in ")]}":
            if depth == 0:
                if text[segment_start:i].strip():
                    items.append(_keyword(text[segment_start:i]))
                return items, i + 1
            depth -= 1
    if final:
        raise NotACall(text[pos:])
    return items, None


def _keyword(segment: str) -> tuple[str, Any]:
    """`name=<Python literal>` as (name, value); the value must be JSON-representable."""
    try:
        call = ast.parse(f"f({segment})", mode="eval").body
        if call.args or len(call.keywords) != 1 or call.keywords[0].arg is None:
            raise NotACall(segment)
        value = ast.literal_eval(call.keywords[0].value)
        json.dumps(value)
    except (SyntaxError, ValueError, TypeError):
        raise NotACall(segment) from None
    return call.keywords[0].arg, value
