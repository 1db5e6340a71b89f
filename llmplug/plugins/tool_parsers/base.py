"""What tool parsers share: the parsed calls, the streaming diff, and readers of calls in partial text.

A parser (`llmplug.tool_parsers` entry point, constructed per request with the request's tools)
implements one method, `snapshot(text, final)`: the content and the tool calls that `text`, all the
output so far, holds. A snapshot only grows as the text grows — the content and each call's arguments
extend what they were — so it holds back text that may still turn into a call (a partial `<tool_call`
tag, a call whose name is not complete). `extract` (a whole output) and `ToolCallStream` (deltas as the
output arrives) are both built on it, so a streamed answer adds up to the whole one, however the text
was split into deltas.
"""

from __future__ import annotations

import abc
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import regex

from llmplug.plugins.partial_text import extension, hold_back, skip_space

logger = logging.getLogger(__name__)

__all__ = [
    "CallRead",
    "ExtractedToolCalls",
    "NotACall",
    "PartialCall",
    "Snapshot",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "arguments_json",
    "json_value_end",
    "read_json_call",
    "read_json_calls",
    "read_tagged_calls",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class PartialCall:
    """A call as far as the text goes: its name (always whole) and the start of its arguments' JSON text."""

    name: str
    arguments: str = ""
    complete: bool = False


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a text holds: content (text for the user) and calls; `malformed` when a call marker led to no call."""

    content: str
    calls: tuple[PartialCall, ...] = ()
    malformed: bool = False


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    """A whole output read: its content (None when it holds only calls) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class ToolCallDelta:
    """What one streamed step adds to call `index`: its name on the first delta, then argument text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class StreamDelta:
    """What one streamed step adds: content text and call deltas."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class NotACall(ValueError):
    """Text at a call marker that is not a call (the caller keeps it as content)."""


class ToolParser(abc.ABC):
    """A model's tool-call format. Subclasses set `name`, `format_hint`, and implement `snapshot`.

    Constructed by the server for each request that has tools, as `Parser(tools)`: the request's
    function definitions (`{"name", "description", "parameters"}` dicts), for formats whose values
    need the parameter types.
    """

    name: str = ""
    # The format's markers are special tokens that the detokenizer must not drop (mistral's [TOOL_CALLS]).
    keep_special_tokens: bool = False
    # How to ask for calls in this format, for a chat template that does not render tools itself.
    format_hint: str = ""

    def __init__(self, tools: Sequence[dict[str, Any]] = ()) -> None:
        self.tools = {tool["name"]: tool for tool in tools}

    @abc.abstractmethod
    def snapshot(self, text: str, final: bool) -> Snapshot:
        """The content and calls of `text`; with `final` False, hold back what may still become a call."""

    def read(self, text: str, final: bool) -> Snapshot | None:
        """`snapshot`, guarded: a parser that finds no call where its format says one starts (NotACall) makes
        the whole text content when `final`, and waits (None) before."""
        try:
            return self.snapshot(text, final)
        except NotACall:
            return Snapshot(text, malformed=True) if final else None

    def extract(self, text: str) -> ExtractedToolCalls:
        """The content and calls of a whole output; a call that cannot be read leaves the whole text as content."""
        snapshot = self.read(text, final=True)
        calls = []
        for call in snapshot.calls:
            if not call.complete or not _is_object(call.arguments):
                return _as_content(text, f"the {self.name} call {call.name!r} has unreadable arguments")
            calls.append(ToolCall(call.name, call.arguments))
        if snapshot.malformed:
            return _as_content(text, f"a {self.name} tool-call marker is followed by no readable call")
        content = snapshot.content
        return ExtractedToolCalls(content if content.strip() or not calls else None, calls)

    def stream(self) -> ToolCallStream:
        """A reader of this output's deltas."""
        return ToolCallStream(self)


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def _as_content(text: str, why: str) -> ExtractedToolCalls:
    logger.info("tool calls: %s; the output is returned as content", why)
    return ExtractedToolCalls(text, [])


class ToolCallStream:
    """Turns output deltas into content and call deltas by comparing snapshots of the growing text."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content = ""  # content sent so far
        self._arguments: list[str] = []  # per call sent: its argument text sent so far

    @property
    def num_calls(self) -> int:
        """Calls sent so far."""
        return len(self._arguments)

    def feed(self, delta: str) -> StreamDelta:
        """What `delta`, the output's next text, adds."""
        self.text += delta
        return self._diff(self.parser.read(self.text, final=False))

    def finish(self) -> StreamDelta:
        """What the end of the output releases (text held back because it might have become a call)."""
        return self._diff(self.parser.read(self.text, final=True))

    def _diff(self, snapshot: Snapshot | None) -> StreamDelta:
        if snapshot is None:
            return StreamDelta()
        delta = StreamDelta(content=extension(self._content, snapshot.content, "tool-call content"))
        self._content += delta.content
        for index, call in enumerate(snapshot.calls):
            if index == len(self._arguments):
                self._arguments.append(call.arguments)
                delta.tool_calls.append(ToolCallDelta(index, call.name, call.arguments))
                continue
            added = extension(self._arguments[index], call.arguments, f"arguments of tool call {index}")
            if added:
                self._arguments[index] += added
                delta.tool_calls.append(ToolCallDelta(index, arguments=added))
        return delta


# --- reading calls in partial text ---------------------------------------------------------------------------------

_CALL_HEADER = regex.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_OBJECT_END = regex.compile(r"\s*\}")
_SCALAR_END = regex.compile(r"[,}\]\s]")


def json_value_end(text: str, start: int) -> int | None:
    """The index past the JSON value that begins at `text[start]`, judged by brackets and strings only;
    None while it is open. A scalar ends where a delimiter follows it."""
    if text[start] not in '{["':
        end = _SCALAR_END.search(text, start)
        return end.start() if end else None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass(frozen=True, slots=True)
class CallRead:
    """A call read from partial text: the call so far (None: nothing to tell yet) and the index past its
    object (None while it is open)."""

    call: PartialCall | None
    end: int | None


_HOLD = CallRead(None, None)


def read_json_call(text: str, start: int, final: bool) -> CallRead:
    """The call whose JSON object `{"name": ..., "arguments" | "parameters": {...}}` begins at `text[start]`.

    Name first (the usual order) streams the arguments as they are written; any other layout is read once
    its object is complete. Raises NotACall when the object is not a call.
    """
    if start >= len(text):
        if final:
            raise NotACall("")
        return _HOLD
    header = _CALL_HEADER.match(text, start, partial=True)
    if header is not None and not header.partial:
        read = _read_after_header(text, json.loads(f'"{header[1]}"'), header.end(), final)
        if read is not None:
            return read
    elif header is not None and not final:
        return _HOLD
    end = json_value_end(text, start)
    if end is None:
        if final:
            raise NotACall(text[start:])
        return _HOLD
    return CallRead(_call_from_object(text[start:end]), end)


def _read_after_header(text: str, name: str, args_start: int, final: bool) -> CallRead | None:
    """The call once its name is known; None when the object goes on past its arguments (read it whole)."""
    if args_start == len(text):
        return CallRead(PartialCall(name), None)
    args_end = json_value_end(text, args_start)
    if text[args_start] == '"':  # arguments given as a string of JSON: released whole
        if args_end is None:
            return CallRead(PartialCall(name), None)
        arguments = json.loads(text[args_start:args_end])
    else:
        arguments = text[args_start:args_end]
    if args_end is None:
        return CallRead(PartialCall(name, arguments), None)
    close = _OBJECT_END.match(text, args_end, partial=not final)
    if close is None:
        return None
    if close.partial:
        return CallRead(PartialCall(name, arguments), None)
    return CallRead(PartialCall(name, arguments, complete=True), close.end())


def _call_from_object(text: str) -> PartialCall:
    try:
        value = json.loads(text)
    except ValueError:
        raise NotACall(text) from None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise NotACall(text)
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return PartialCall(value["name"], arguments, complete=True)
    return PartialCall(value["name"], json.dumps(arguments), complete=True)


_ITEM_SEPARATOR = regex.compile(r"\s*([,\]])")


def read_json_calls(text: str, start: int, final: bool) -> tuple[list[PartialCall], int | None]:
    """The calls of a JSON array of call objects that begins at `text[start]` (`[`): the calls so far and the
    index past the array (None while it is open). Raises NotACall when an item is not a call."""
    calls: list[PartialCall] = []
    pos = skip_space(text, start + 1)
    if text.startswith("]", pos):
        return calls, pos + 1
    while True:
        read = read_json_call(text, pos, final)
        if read.call is not None:
            calls.append(read.call)
        if read.end is None:
            return calls, None
        separator = _ITEM_SEPARATOR.match(text, read.end)
        if separator is None:
            if final or text[read.end:].strip():
                raise NotACall(text[read.end:])
            return calls, None
        if separator[1] == "]":
            return calls, separator.end()
        pos = skip_space(text, separator.end())


def arguments_json(items: Sequence[tuple[str, Any]], complete: bool) -> str:
    """Arguments read one by one as JSON text that grows with them: `{"a": 1, "b": 2` then `}` when complete.
    Equal to json.dumps of the whole dict, so a streamed call adds up to the whole one."""
    text = "{" + ", ".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in items)
    return text + "}" if complete else text


def read_tagged_calls(text: str, final: bool, start_tag: str, end_tag: str,
                      read_body: Callable[[str, int, bool], CallRead]) -> Snapshot:
    """Calls that each sit between `start_tag` and `end_tag`, with content around them.

    `read_body(text, pos, final)` reads one call from `pos` (after the start tag and whitespace). A region
    whose body is not a call is content, and marks the snapshot malformed. Content between and after calls
    counts only when it is more than whitespace.
    """
    segments, calls, pos, malformed = [], [], 0, False
    closing = regex.compile(r"\s*" + regex.escape(end_tag))
    while True:
        start = text.find(start_tag, pos)
        if start < 0:
            segments.append(text[pos:] if final else hold_back(text[pos:], start_tag))
            break
        segments.append(text[pos:start])
        try:
            read = read_body(text, skip_space(text, start + len(start_tag)), final)
        except NotACall:
            end = text.find(end_tag, start)
            if end < 0 and not final:
                break  # the region is still open: its extent, and so the content, is not known yet
            pos = len(text) if end < 0 else end + len(end_tag)
            segments.append(text[start:pos])
            malformed = True
            continue
        if read.call is not None:
            calls.append(read.call)
        if read.end is None:
            break
        close = closing.match(text, read.end, partial=not final)
        if close is not None and close.partial:
            break
        pos = read.end if close is None else close.end()  # a missing end tag is forgiven
    content = segments[0] + "".join(s for s in segments[1:] if s.strip())
    return Snapshot(content, tuple(calls), malformed)
