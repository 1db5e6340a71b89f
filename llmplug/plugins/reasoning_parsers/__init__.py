"""llmplug.plugins.reasoning_parsers: the in-tree `llmplug.reasoning_parsers` plugins (deepseek_r1, qwen3)
and their base class, `ReasoningParser`."""

from llmplug.plugins.reasoning_parsers.base import ReasoningDelta, ReasoningParser, ReasoningStart

__all__ = ["ReasoningDelta", "ReasoningParser", "ReasoningStart"]
