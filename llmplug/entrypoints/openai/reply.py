"""Reading an answer into its parts: reasoning (the reasoning parser), then tool calls (the tool parser) and
content, whole or as it streams. One `ReplyReader` per request; one stream per choice."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginRegistry
from llmplug.plugins.reasoning_parsers.base import ReasoningParser, ReasoningStart
from llmplug.plugins.tool_parsers.base import StreamDelta, ToolCall, ToolCallDelta, ToolParser


def call_id() -> str:
    """A new tool call id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class Reply:
    """A whole answer's parts."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class ReplyDelta:
    """What one streamed step adds to each part; a call's first delta carries its new id."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[str | None, ToolCallDelta]] = field(default_factory=list)  # (new id, delta)

    def extend(self, other: ReplyDelta) -> ReplyDelta:
        """This delta followed by `other`."""
        return ReplyDelta(self.reasoning + other.reasoning, self.content + other.content,
                          self.tool_calls + other.tool_calls)


class ReplyReader:
    """How one request's answers are read: reasoning first (when the server has a reasoning parser), then the
    calls in the rest (when the request may make some)."""

    def __init__(self, reasoning: ReasoningParser | None, reasoning_start: ReasoningStart,
                 tool_parser: ToolParser | None, max_calls: int | None = None) -> None:
        self.reasoning = reasoning
        self.reasoning_start = reasoning_start
        self.tool_parser = tool_parser
        self.max_calls = max_calls  # 1 with parallel_tool_calls false: later calls are dropped, as vLLM does

    @property
    def plain(self) -> bool:
        """True when an answer is all content: no reasoning to take apart, no calls to look for."""
        return self.reasoning is None and self.tool_parser is None

    def whole(self, text: str) -> Reply:
        """The parts of a whole answer."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text, self.reasoning_start)
        if self.tool_parser is None:
            return Reply(reasoning, content)
        extracted = self.tool_parser.extract(content or "")
        return Reply(reasoning, extracted.content, extracted.tool_calls[:self.max_calls])

    def stream(self) -> ReplyStream:
        """A reader of one choice's deltas."""
        return ReplyStream(self)


class ReplyStream:
    """The parts one choice's deltas add."""

    def __init__(self, reader: ReplyReader) -> None:
        self._reasoning = reader.reasoning.stream(reader.reasoning_start) if reader.reasoning else None
        self._tools = reader.tool_parser.stream() if reader.tool_parser else None
        self._max_calls = reader.max_calls
        self._ids: list[str] = []

    @property
    def num_calls(self) -> int:
        """Calls sent so far."""
        return len(self._ids)

    def feed(self, text: str) -> ReplyDelta:
        """What the answer's next text adds."""
        if self._reasoning is None:
            return self._after_reasoning("", text)
        delta = self._reasoning.feed(text)
        return self._after_reasoning(delta.reasoning, delta.content)

    def finish(self) -> ReplyDelta:
        """What the end of the answer releases."""
        reasoning = self._reasoning.finish() if self._reasoning else None
        delta = self._after_reasoning(reasoning.reasoning if reasoning else "", reasoning.content if reasoning else "")
        if self._tools is not None:
            self._add(delta, self._tools.finish())
        return delta

    def _after_reasoning(self, reasoning: str, content: str) -> ReplyDelta:
        delta = ReplyDelta(reasoning=reasoning)
        if self._tools is None:
            delta.content = content
        elif content:
            self._add(delta, self._tools.feed(content))
        return delta

    def _add(self, delta: ReplyDelta, tools: StreamDelta) -> None:
        delta.content += tools.content
        for call in tools.tool_calls:
            if self._max_calls is not None and call.index >= self._max_calls:
                continue
            new_id = None
            if call.index == len(self._ids):
                new_id = call_id()
                self._ids.append(new_id)
            delta.tool_calls.append((new_id, call))


TOOL_PARSERS = "llmplug.tool_parsers"
REASONING_PARSERS = "llmplug.reasoning_parsers"


def check_parser_names(tool_call_parser: str | None, enable_auto_tool_choice: bool,
                       reasoning_parser: str | None, registry: PluginRegistry) -> None:
    """Refuse parser flags that cannot work, before the engine loads (PluginNotFoundError lists the names)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (the format of the model's calls)")
    if tool_call_parser:
        registry.resolve(TOOL_PARSERS, tool_call_parser)
    if reasoning_parser:
        registry.resolve(REASONING_PARSERS, reasoning_parser)


@dataclass(frozen=True, slots=True)
class ReplyParsers:
    """The server's parsers: `--tool-call-parser` (with `--enable-auto-tool-choice`) and `--reasoning-parser`."""

    tool_parser: type[ToolParser] | None = None
    auto_tool_choice: bool = False
    reasoning: ReasoningParser | None = None

    @classmethod
    def load(cls, tool_call_parser: str | None, enable_auto_tool_choice: bool, reasoning_parser: str | None,
             tokenizer: Any, registry: PluginRegistry) -> ReplyParsers:
        """The parsers registered under these names (`llmplug.tool_parsers`, `llmplug.reasoning_parsers`) in
        `registry`, the served engine's."""
        check_parser_names(tool_call_parser, enable_auto_tool_choice, reasoning_parser, registry)
        tool_parser = registry.load(TOOL_PARSERS, tool_call_parser) if tool_call_parser else None
        reasoning = None
        if reasoning_parser:
            if tokenizer is None:
                raise ConfigError("--reasoning-parser needs the model's tokenizer (not skip_tokenizer_init)")
            reasoning = registry.load(REASONING_PARSERS, reasoning_parser)(tokenizer)
        return cls(tool_parser, enable_auto_tool_choice, reasoning)

    def reader(self, tool_parser: ToolParser | None, prompt_text: str, max_calls: int | None) -> ReplyReader:
        """The reader of the answers to a prompt, with the request's tool parser (None: no calls)."""
        start = self.reasoning.start(prompt_text) if self.reasoning else ReasoningStart.ANSWER
        return ReplyReader(self.reasoning, start, tool_parser, max_calls)

    def grammar_start(self, reader: ReplyReader) -> tuple[int, ...]:
        """The tokens after which a grammar applies: the end of the reasoning when the answer starts with it."""
        if self.reasoning is None or reader.reasoning_start is ReasoningStart.ANSWER:
            return ()
        return self.reasoning.end_token_ids()
