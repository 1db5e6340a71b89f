"""Reasoning parsers: split a model's output into its reasoning (`<think>...</think>`) and its answer.

A parser (`llmplug.reasoning_parsers` entry point) is constructed once per server with the model's
tokenizer. For each request the server asks where the output starts (`start(prompt_text)`: in the
reasoning, in the answer, or as the output's first tag says), then reads the whole output (`extract`)
or its deltas (`stream`). Both go through `snapshot`, which holds back a tag cut in two, so a streamed
answer adds up to the whole one however the text was split. `end_token_ids` is what the engine waits
for before a grammar (response_format, tool_choice) applies: the grammar constrains the answer only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from llmplug.plugins.partial_text import extension, hold_back

__all__ = ["ReasoningDelta", "ReasoningParser", "ReasoningStart", "ReasoningStream"]


class ReasoningStart(enum.Enum):
    """Where a request's output begins."""

    REASONING = "reasoning"  # the prompt opened the reasoning, or the model always reasons first
    ANSWER = "answer"  # the prompt closed the reasoning (thinking turned off in the template)
    BY_TAG = "by_tag"  # reasoning when the output starts with the start tag, else all answer


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Reasoning and answer text: of a whole output, or what one streamed delta adds."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """`<think>`-style reasoning. Subclasses set `name`, the tags, and whether reasoning needs the start tag."""

    name: str = ""
    start_tag = "<think>"
    end_tag = "</think>"
    always_reasons = False  # True: the output is reasoning up to the end tag even without a start tag

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def end_token_ids(self) -> tuple[int, ...]:
        """The tokens of the end tag: the engine starts a request's grammar once the output produced them."""
        return tuple(self.tokenizer.encode(self.end_tag, add_special_tokens=False))

    def start(self, prompt_text: str) -> ReasoningStart:
        """Where the output of a request with this prompt begins."""
        tail = prompt_text.rstrip()
        if tail.endswith(self.end_tag):
            return ReasoningStart.ANSWER
        if tail.endswith(self.start_tag) or self.always_reasons:
            return ReasoningStart.REASONING
        return ReasoningStart.BY_TAG

    def snapshot(self, text: str, start: ReasoningStart, final: bool) -> ReasoningDelta:
        """The reasoning and answer of `text`, the output so far; with `final` False a cut tag waits."""
        if start is ReasoningStart.ANSWER:
            return ReasoningDelta(content=text)
        body = text.lstrip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag):]
        elif not final and self.start_tag.startswith(body):
            return ReasoningDelta()  # nothing yet, or a start tag cut in two
        elif start is ReasoningStart.BY_TAG:
            return ReasoningDelta(content=text)
        end = body.find(self.end_tag)
        if end < 0:
            reasoning = body if final else hold_back(body, self.end_tag)
            return ReasoningDelta(reasoning=reasoning.strip())
        return ReasoningDelta(reasoning=body[:end].strip(), content=body[end + len(self.end_tag):].lstrip())

    def extract(self, text: str, start: ReasoningStart) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is empty."""
        whole = self.snapshot(text, start, final=True)
        return whole.reasoning or None, whole.content or None

    def stream(self, start: ReasoningStart) -> ReasoningStream:
        """A reader of one output's deltas."""
        return ReasoningStream(self, start)


class ReasoningStream:
    """Turns output deltas into reasoning and answer deltas by comparing snapshots of the growing text."""

    def __init__(self, parser: ReasoningParser, start: ReasoningStart) -> None:
        self.parser = parser
        self.start = start
        self.text = ""
        self._sent = ReasoningDelta()

    def feed(self, delta: str) -> ReasoningDelta:
        """What `delta`, the output's next text, adds."""
        self.text += delta
        return self._diff(final=False)

    def finish(self) -> ReasoningDelta:
        """What the end of the output releases (a held-back partial tag)."""
        return self._diff(final=True)

    def _diff(self, final: bool) -> ReasoningDelta:
        now = self.parser.snapshot(self.text, self.start, final)
        added = ReasoningDelta(extension(self._sent.reasoning, now.reasoning, "reasoning"),
                               extension(self._sent.content, now.content, "answer"))
        self._sent = ReasoningDelta(self._sent.reasoning + added.reasoning, self._sent.content + added.content)
        return added
