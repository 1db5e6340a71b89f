"""What tool parsers share: the parsed calls, the streaming diff, and readers of calls in partial text.

A parser (`llmplug.tool_parsers` entry point, constructed per request with the request's tools)
implements one method, `snapshot(text, final)`: the content and the tool calls that `text`, all the
output so far, holds. A snapshot only grows as the text grows — the content and each call's arguments
extend what they were — so it holds back text that may still turn into a call (a partial `<tool_call`
tag, a call whose name is not complete). `extract` (a whole output) and `ToolCallStream` (deltas as the
output arrives) are both built on it, so a streamed answer adds up to the whole one, however the text
was split into deltas.

Read from the start at every delta, a stream costs time quadratic in its length. A parser whose reading
can start over at a settled point (after a complete call, inside content that can no longer become a
call) also implements `snapshot_after(text, final, resume)`: the reading from a `Resume` on, which names
the next such point. The stream then reads each delta from the last settled point, so content and
finished calls are read once (the in-tree tagged formats do: hermes, qwen3_xml, mistral's content).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import regex

from llmplug.plugins.partial_text import extension, hold_back, skip_space

logger = logging.getLogger(__name__)

__all__ = [
    "CallRead",
    "JsonScan",
    "ExtractedToolCalls",
    "NotACall",
    "PartialCall",
    "Resume",
    "START",
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
class Resume:
    """Where the reading of a growing text may start over: at `pos`, with `num_content` characters of content
    and `num_calls` complete calls before it read for good; `after_call`: a call ends there (the content that
    follows counts only when it is more than whitespace)."""

    pos: int = 0
    num_content: int = 0
    num_calls: int = 0
    after_call: bool = False
    state: Any = field(default=None, compare=False)  # the parser's own, to go on from (e.g. its JSON scans)


START = Resume()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a text holds: content (text for the user) and calls; `malformed` when a call marker led to no call.

    Read with `snapshot_after(..., resume)`, the content and calls are those after `resume`, and `resume` is
    the next point where a longer text's reading may start over (None: where this one started)."""

    content: str
    calls: tuple[PartialCall, ...] = ()
    malformed: bool = False
    resume: Resume | None = None


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

    def snapshot_after(self, text: str, final: bool, resume: Resume) -> Snapshot:
        """The reading of `text` from `resume` on (see Snapshot). This default reads from the start every
        time and never names a resume point; a parser that can start over overrides it."""
        return self.snapshot(text, final)

    def read(self, text: str, final: bool, resume: Resume = START) -> Snapshot | None:
        """`snapshot_after`, guarded: a parser that finds no call where its format says one starts (NotACall)
        makes the text from `resume` on content when `final`, and waits (None) before."""
        try:
            return self.snapshot_after(text, final, resume)
        except NotACall:
            return Snapshot(text[resume.pos:], malformed=True) if final else None

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
    """Turns output deltas into content and call deltas by comparing snapshots of the growing text, each read
    from the last point the parser settled (`Resume`)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._resume = START
        self._content = ""  # content sent past the resume point
        self._arguments: list[str] = []  # per call sent: its argument text sent so far

    @property
    def num_calls(self) -> int:
        """Calls sent so far."""
        return len(self._arguments)

    def feed(self, delta: str) -> StreamDelta:
        """What `delta`, the output's next text, adds."""
        self.text += delta
        return self._diff(self.parser.read(self.text, False, self._resume))

    def finish(self) -> StreamDelta:
        """What the end of the output releases (text held back because it might have become a call)."""
        return self._diff(self.parser.read(self.text, True, self._resume))

    def _diff(self, snapshot: Snapshot | None) -> StreamDelta:
        if snapshot is None:
            return StreamDelta()
        delta = StreamDelta(content=extension(self._content, snapshot.content, "tool-call content"))
        self._content += delta.content
        first = self._resume.num_calls  # the snapshot's calls come after the resume point's
        for index, call in enumerate(snapshot.calls, start=first):
            if index == len(self._arguments):
                self._arguments.append(call.arguments)
                delta.tool_calls.append(ToolCallDelta(index, call.name, call.arguments))
                continue
            added = extension(self._arguments[index], call.arguments, f"arguments of tool call {index}")
            if added:
                self._arguments[index] += added
                delta.tool_calls.append(ToolCallDelta(index, arguments=added))
        if snapshot.resume is not None:  # what lies before the new point is read for good: forget it
            self._content = self._content[snapshot.resume.num_content - self._resume.num_content:]
            self._resume = snapshot.resume
        return delta


# --- reading calls in partial text ---------------------------------------------------------------------------------

_CALL_HEADER = regex.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_OBJECT_END = regex.compile(r"\s*\}")
_SCALAR_END = regex.compile(r"[,}\]\s]")


def json_value_end(text: str, start: int, scans: dict[int, JsonScan] | None = None) -> int | None:
    """The index past the JSON value that begins at `text[start]`, judged by brackets and strings only;
    None while it is open. A scalar ends where a delimiter follows it. With `scans` (kept across the readings
    of one growing text), the scan of a value goes on from where the last reading stopped."""
    if scans is None:
        return JsonScan(start).end(text)
    return scans.setdefault(start, JsonScan(start)).end(text)


class JsonScan:
    """A scan for the end of the JSON value at `start` that can go on as the text grows (brackets and strings
    only); it remembers where it stopped, so a streamed value is scanned once however many deltas it takes."""

    __slots__ = ("start", "pos", "depth", "in_string", "escaped", "found")

    def __init__(self, start: int) -> None:
        self.start, self.pos, self.depth, self.in_string, self.escaped = start, start, 0, False, False
        self.found: int | None = None

    def end(self, text: str) -> int | None:
        """The index past the value in `text` (which extends the texts scanned before), or None while it is open."""
        if self.found is None:
            self.found = self._scalar_end(text) if text[self.start] not in '{["' else self._bracketed_end(text)
        return self.found

    def _scalar_end(self, text: str) -> int | None:
        end = _SCALAR_END.search(text, self.pos)
        self.pos = len(text)
        return end.start() if end else None

    def _bracketed_end(self, text: str) -> int | None:
        for i in range(self.pos, len(text)):
            char = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        self.pos = len(text)
        return None


@dataclass(frozen=True, slots=True)
class CallRead:
    """A call read from partial text: the call so far (None: nothing to tell yet) and the index past its
    object (None while it is open)."""

    call: PartialCall | None
    end: int | None


_HOLD = CallRead(None, None)


def read_json_call(text: str, start: int, final: bool, scans: dict[int, JsonScan] | None = None) -> CallRead:
    """The call whose JSON object `{"name": ..., "arguments" | "parameters": {...}}` begins at `text[start]`.

    Name first (the usual order) streams the arguments as they are written; any other layout is read once
    its object is complete. Raises NotACall when the object is not a call. `scans`: see json_value_end.
    """
    if start >= len(text):
        if final:
            raise NotACall("")
        return _HOLD
    header = _CALL_HEADER.match(text, start, partial=True)
    if header is not None and not header.partial:
        read = _read_after_header(text, json.loads(f'"{header[1]}"'), header.end(), final, scans)
        if read is not None:
            return read
    elif header is not None and not final:
        return _HOLD
    end = json_value_end(text, start, scans)
    if end is None:
        if final:
            raise NotACall(text[start:])
        return _HOLD
    return CallRead(_call_from_object(text[start:end]), end)


def _read_after_header(text: str, name: str, args_start: int, final: bool,
                       scans: dict[int, JsonScan] | None) -> CallRead | None:
    """The call once its name is known; None when the object goes on past its arguments (read it whole)."""
    if args_start == len(text):
        return CallRead(PartialCall(name), None)
    args_end = json_value_end(text, args_start, scans)
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


def read_json_calls(text: str, start: int, final: bool,
                    scans: dict[int, JsonScan] | None = None) -> tuple[list[PartialCall], int | None]:
    """The calls of a JSON array of call objects that begins at `text[start]` (`[`): the calls so far and the
    index past the array (None while it is open). Raises NotACall when an item is not a call. `scans`: see
    json_value_end."""
    calls: list[PartialCall] = []
    pos = skip_space(text, start + 1)
    if text.startswith("]", pos):
        return calls, pos + 1
    while True:
        read = read_json_call(text, pos, final, scans)
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
                      read_body: Callable[[str, int, bool], CallRead], resume: Resume = START,
                      state: Any = None) -> Snapshot:
    """Calls that each sit between `start_tag` and `end_tag`, with content around them, read from `resume` on.

    `read_body(text, pos, final)` reads one call from `pos` (after the start tag and whitespace). A region
    whose body is not a call is content, and marks the snapshot malformed. Content between and after calls
    counts only when it is more than whitespace. The snapshot's `resume` is past the last closed call, or
    past the content that can no longer become a call (or `resume` itself), and carries `state` along.
    """
    reading = _TaggedReading(resume, state)
    pos = resume.pos
    closing = regex.compile(r"\s*" + regex.escape(end_tag))
    while True:
        start = text.find(start_tag, pos)
        if start < 0:
            reading.add_content(text[pos:] if final else hold_back(text[pos:], start_tag), pos)
            break
        reading.add_segment(text[pos:start])
        try:
            read = read_body(text, skip_space(text, start + len(start_tag)), final)
        except NotACall:
            end = text.find(end_tag, start)
            if end < 0 and not final:
                break  # the region is still open: its extent, and so the content, is not known yet
            pos = len(text) if end < 0 else end + len(end_tag)
            reading.add_segment(text[start:pos])
            reading.malformed = True
            continue
        if read.call is not None:
            reading.calls.append(read.call)
        if read.end is None:
            break
        close = closing.match(text, read.end, partial=not final)
        if close is not None and close.partial:
            break
        pos = read.end if close is None else close.end()  # a missing end tag is forgiven
        reading.settle(pos, after_call=True)
    return reading.snapshot()


class _TaggedReading:
    """The content segments and calls of a tagged reading from a resume point, and the next resume point."""

    def __init__(self, resume: Resume, state: Any) -> None:
        self.start, self.state = resume, state
        self.resume: Resume | None = None
        self.content = ""
        self.calls: list[PartialCall] = []
        self.malformed = False
        self._blank_counts = not resume.after_call  # the first segment counts even when blank, unless after a call
        self._first = True

    def add_segment(self, segment: str) -> None:
        """Content between calls: the first one counts (unless it follows a call), later ones when not blank."""
        if (self._first and self._blank_counts) or segment.strip():
            self.content += segment
        self._first = False

    def add_content(self, segment: str, pos: int) -> None:
        """The last segment, up to where a call may still start: it is settled when it counts."""
        counts = (self._first and self._blank_counts) or bool(segment.strip())
        self.add_segment(segment)
        if counts and segment:
            self.settle(pos + len(segment), after_call=False)  # the rest of it counts as it comes

    def settle(self, pos: int, after_call: bool) -> None:
        """Everything read up to `pos` is final: a later reading may start there."""
        self.resume = Resume(pos, self.start.num_content + len(self.content), self.start.num_calls + len(self.calls),
                             after_call, self.state)

    def snapshot(self) -> Snapshot:
        resume = self.resume or dataclasses.replace(self.start, state=self.state)
        return Snapshot(self.content, tuple(self.calls), self.malformed, resume)
