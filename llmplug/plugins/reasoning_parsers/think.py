"""The `<think>...</think>` reasoning parsers: `deepseek_r1` and `qwen3`."""

from __future__ import annotations

from llmplug.plugins.reasoning_parsers.base import ReasoningParser

LLMPLUG_PLUGIN_API_VERSION = "1.2"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 always reasons first; its template may already hold the `<think>`, so the output is
    reasoning up to `</think>` with or without a start tag."""

    name = "deepseek_r1"
    always_reasons = True


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 reasons when its output starts with `<think>`; with thinking turned off its template closes an
    empty `<think></think>` in the prompt, and the whole output is the answer."""

    name = "qwen3"
