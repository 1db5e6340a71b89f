"""The `llama3_json` tool parser: Llama 3.1 / 3.2 answer a call with the JSON object
`{"name": ..., "parameters": {...}}` as the whole output (after an optional `<|python_tag|>`), several
separated by `;`."""

from __future__ import annotations

import regex

from llmplug.plugins.partial_text import skip_space
from llmplug.plugins.tool_parsers.base import NotACall, PartialCall, Snapshot, ToolParser, read_json_call

LLMPLUG_PLUGIN_API_VERSION = "1.2"

PYTHON_TAG = "<|python_tag|>"
_SEPARATOR = regex.compile(r"\s*;\s*")


class Llama3JsonToolParser(ToolParser):
    """An output that starts with a JSON object is read as calls; any other output is content."""

    name = "llama3_json"
    keep_special_tokens = True  # <|python_tag|> is a special token
    format_hint = ('To call a function, answer with only the JSON object {"name": <function name>, "parameters": '
                   '<arguments as a JSON object>}; separate several calls with ";".')

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, start):
            start = skip_space(text, start + len(PYTHON_TAG))
            if start == len(text) and not final:
                return Snapshot("")
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return Snapshot("")  # empty so far, or a tag cut in two
        if start == len(text) or text[start] != "{":
            return Snapshot(text)
        calls: list[PartialCall] = []
        pos = start
        while True:
            try:
                read = read_json_call(text, pos, final)
            except NotACall:
                return Snapshot(text if not calls else text[pos:], tuple(calls), malformed=bool(calls))
            if read.call is not None:
                calls.append(read.call)
            if read.end is None:
                return Snapshot("", tuple(calls))
            separator = _SEPARATOR.match(text, read.end)
            if separator is not None and text.startswith("{", separator.end()):
                pos = separator.end()
                continue
            rest = "" if separator is not None and separator.end() == len(text) else text[read.end:]
            return Snapshot(rest if rest.strip() else "", tuple(calls))
