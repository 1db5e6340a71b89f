"""The `qwen3_xml` tool parser: Qwen3-Coder writes each call as XML-like tags in `<tool_call>`:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is converted by its type in the tool's JSON schema (a string stays
text; numbers, booleans, objects and arrays are read as JSON, and stay text when they are not JSON).
"""

from __future__ import annotations

import json
from typing import Any

import regex

from llmplug.plugins.tool_parsers.base import (
    START,
    CallRead,
    NotACall,
    PartialCall,
    Resume,
    Snapshot,
    ToolParser,
    arguments_json,
    read_tagged_calls,
)

LLMPLUG_PLUGIN_API_VERSION = "1.2"

_FUNCTION = regex.compile(r"<function=([^>\n]+)>")
_PARAMETER = regex.compile(r"\s*<parameter=([^>\n]+)>\n?")
_FUNCTION_END = regex.compile(r"\s*</function>")
PARAMETER_END = "</parameter>"


class Qwen3XmlToolParser(ToolParser):
    """Calls in `<tool_call>` tags, as `<function=...>` with `<parameter=...>` children."""

    name = "qwen3_xml"
    format_hint = ("To call a function, write <tool_call>\n<function=NAME>\n<parameter=PARAM>\nVALUE\n</parameter>\n"
                   "</function>\n</tool_call>, with one <parameter> per argument, once per call.")

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return self.snapshot_after(text, final, START)

    def snapshot_after(self, text: str, final: bool, resume: Resume) -> Snapshot:
        return read_tagged_calls(text, final, "<tool_call>", "</tool_call>", self._read_function, resume)

    def _read_function(self, text: str, pos: int, final: bool) -> CallRead:
        head = _FUNCTION.match(text, pos, partial=not final)
        if head is None:
            raise NotACall(text[pos:])
        if head.partial:
            return CallRead(None, None)
        name, items, pos = head[1].strip(), [], head.end()
        while True:
            parameter = _PARAMETER.match(text, pos, partial=not final)
            if parameter is not None and not parameter.partial:
                end = text.find(PARAMETER_END, parameter.end())
                if end < 0:
                    break
                value = text[parameter.end():end].removesuffix("\n")
                items.append((parameter[1].strip(), self._convert(name, parameter[1].strip(), value)))
                pos = end + len(PARAMETER_END)
                continue
            close = _FUNCTION_END.match(text, pos, partial=not final)
            if close is not None and not close.partial:
                return CallRead(PartialCall(name, arguments_json(items, complete=True), complete=True), close.end())
            if parameter is None and close is None:
                raise NotACall(text[pos:])
            break
        if final:
            raise NotACall(text[pos:])
        return CallRead(PartialCall(name, arguments_json(items, complete=False)), None)

    def _convert(self, function: str, parameter: str, value: str) -> Any:
        """The value as its schema type says: text for strings, else JSON (text when it is not JSON)."""
        schema = (self.tools.get(function) or {}).get("parameters") or {}
        kind = ((schema.get("properties") or {}).get(parameter) or {}).get("type")
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return value
        try:
            return json.loads(value)
        except ValueError:
            return value
