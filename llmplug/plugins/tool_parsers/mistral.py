"""The `mistral` tool parser: Mistral models write `[TOOL_CALLS]` and then the calls, either as a JSON array
`[{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11) or as `name[ARGS]{...}`, each call after
its own `[TOOL_CALLS]` (v11 and later)."""

from __future__ import annotations

import dataclasses

import regex

from llmplug.plugins.partial_text import hold_back, skip_space
from llmplug.plugins.tool_parsers.base import (
    START,
    JsonScan,
    NotACall,
    PartialCall,
    Resume,
    Snapshot,
    ToolParser,
    json_value_end,
    read_json_calls,
)

LLMPLUG_PLUGIN_API_VERSION = "1.2"

TOOL_CALLS = "[TOOL_CALLS]"
_NAMED_CALL = regex.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\]")


class MistralToolParser(ToolParser):
    """Content up to `[TOOL_CALLS]`, calls after it."""

    name = "mistral"
    keep_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens
    format_hint = ('To call functions, write [TOOL_CALLS] followed by a JSON array of calls: [{"name": <function '
                   'name>, "arguments": <arguments as a JSON object>}, ...].')

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return self.snapshot_after(text, final, START)

    def snapshot_after(self, text: str, final: bool, resume: Resume) -> Snapshot:
        """Content before the marker is settled as it comes (the reading resumes past it); the calls after
        the marker are read at each delta, each call's JSON scanned once."""
        marker = text.find(TOOL_CALLS, resume.pos)
        if marker < 0:
            content = text[resume.pos:] if final else hold_back(text[resume.pos:], TOOL_CALLS)
            return Snapshot(content, resume=Resume(resume.pos + len(content), resume.num_content + len(content)))
        content, start = text[resume.pos:marker], skip_space(text, marker + len(TOOL_CALLS))
        scans = resume.state if resume.state is not None else {}  # each call's JSON is scanned once
        try:
            if text.startswith("[", start):
                calls, _ = read_json_calls(text, start, final, scans)
            else:
                calls = _named_calls(text, start, final, scans)
        except NotACall:
            if not final:
                return Snapshot(content)
            return Snapshot(text[resume.pos:], malformed=True)
        return Snapshot(content, tuple(calls), resume=dataclasses.replace(resume, state=scans))


def _named_calls(text: str, pos: int, final: bool, scans: dict[int, JsonScan]) -> list[PartialCall]:
    """The calls `name[ARGS]{...}`, each after a `[TOOL_CALLS]` (the first one's already read)."""
    calls: list[PartialCall] = []
    while True:
        head = _NAMED_CALL.match(text, pos, partial=not final)
        if head is None:
            raise NotACall(text[pos:])
        if head.partial:
            return calls
        args_start = skip_space(text, head.end())
        if args_start == len(text):
            if final:
                raise NotACall(text[pos:])
            calls.append(PartialCall(head[1]))
            return calls
        args_end = json_value_end(text, args_start, scans)
        calls.append(PartialCall(head[1], text[args_start:args_end], complete=args_end is not None))
        if args_end is None:
            return calls
        pos = skip_space(text, args_end)
        if not text.startswith(TOOL_CALLS, pos):
            return calls
        pos = skip_space(text, pos + len(TOOL_CALLS))
