"""llmplug.plugins.tool_parsers: the in-tree `llmplug.tool_parsers` plugins (hermes, llama3_json, mistral,
pythonic, qwen3_xml) and their base class, `ToolParser`."""

from llmplug.plugins.tool_parsers.base import ExtractedToolCalls, StreamDelta, ToolCall, ToolCallDelta, ToolParser

__all__ = ["ExtractedToolCalls", "StreamDelta", "ToolCall", "ToolCallDelta", "ToolParser"]
