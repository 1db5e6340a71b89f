"""The `hermes` tool parser: Hermes, Qwen2.5 and Qwen3 write each call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

from llmplug.plugins.tool_parsers.base import Snapshot, ToolParser, read_json_call, read_tagged_calls

LLMPLUG_PLUGIN_API_VERSION = "1.2"


class HermesToolParser(ToolParser):
    """Calls in `<tool_call>` tags, each a JSON object with `name` and `arguments`; text around them is content."""

    name = "hermes"
    format_hint = ('To call a function, write <tool_call>{"name": <function name>, "arguments": <arguments as a '
                   'JSON object>}</tool_call>, once per call.')

    def snapshot(self, text: str, final: bool) -> Snapshot:
        return read_tagged_calls(text, final, "<tool_call>", "</tool_call>", read_json_call)
