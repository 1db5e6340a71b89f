"""Example tool-parser plugin: calls written as `>>>name` followed by the arguments object, one per call.

    Let me look that up.
    >>>get_weather
    {"city": "Paris"}

Registered as `llmplug.tool_parsers` "toy_arrows": `llmplug serve --tool-call-parser toy_arrows
--enable-auto-tool-choice` uses it, with no change to llmplug. It implements only `snapshot`, with the
helpers of `llmplug.plugins.tool_parsers.base`; streaming and whole answers come from the base class.
"""

from __future__ import annotations

import regex

from llmplug.plugins.partial_text import hold_back, skip_space
from llmplug.plugins.tool_parsers.base import PartialCall, Snapshot, ToolParser, json_value_end

LLMPLUG_PLUGIN_API_VERSION = "1.2"

ARROW = ">>>"
_NAME = regex.compile(r"([A-Za-z_][\w.\-]*)\n")


class ArrowToolParser(ToolParser):
    """Content up to the first `>>>`, then calls."""

    name = "toy_arrows"
    format_hint = "To call a function, write >>> and its name on one line, then its arguments as a JSON object."

    def snapshot(self, text: str, final: bool) -> Snapshot:
        start = text.find(ARROW)
        if start < 0:
            return Snapshot(text if final else hold_back(text, ARROW))
        calls = []
        while start >= 0:
            name = _NAME.match(text, start + len(ARROW), partial=not final)
            if name is None:
                return Snapshot(text, malformed=True) if final else Snapshot(text[:start], tuple(calls))
            if name.partial:
                break
            args_start = skip_space(text, name.end())
            end = json_value_end(text, args_start) if args_start < len(text) else None
            calls.append(PartialCall(name[1], text[args_start:end], complete=end is not None))
            if end is None:
                break
            start = text.find(ARROW, end)
        return Snapshot(text[:text.find(ARROW)], tuple(calls))
