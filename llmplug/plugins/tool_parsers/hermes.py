"""The `hermes` tool parser: Hermes, Qwen2.5 and Qwen3 write each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import functools

from llmplug.plugins.tool_parsers.base import START, Resume, Snapshot, ToolParser, read_json_call, read_tagged_calls

LLMPLUG_PLUGIN_API_VERSION = "1.2"


class HermesToolParser(ToolParser):
    """Calls in `<tool_call>` tags, each a JSON object with `name` and `arguments`; text around them is content."""

    name = "hermes"
    format_hint = ('To call a function, write <tool_call>{"name": <function name>, "arguments": <arguments as a '
                   'JSON object>}</tool_call>, once per call.')

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return self.snapshot_after(text, final, START)

    def snapshot_after(self, text: str, final: bool, resume: Resume) -> Snapshot:
        scans = resume.state if resume.state is not None else {}  # a call's JSON is scanned once as it streams
        body = functools.partial(read_json_call, scans=scans)
        return read_tagged_calls(text, final, "<tool_call>", "</tool_call>", body, resume, scans)
