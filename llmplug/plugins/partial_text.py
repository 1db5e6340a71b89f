"""Reading a model's output while it is still being written: markers that may be cut in two, and deltas.

The tool-call and reasoning parsers read the whole output so far at every delta and send what it adds
(`extension`); text that may be the start of a marker (`<think`, `<tool_ca`) waits for the next delta
(`hold_back`).
"""

from __future__ import annotations

import logging

import regex

logger = logging.getLogger(__name__)

_SPACE = regex.compile(r"\s*")


def skip_space(text: str, pos: int) -> int:
    """The index of the first non-whitespace character at or after `pos`."""
    return _SPACE.match(text, pos).end()


def hold_back(text: str, *markers: str) -> str:
    """`text` without a tail that could be the start of one of `markers` (the next delta may complete it)."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in markers):
            return text[:-size]
    return text


def extension(sent: str, now: str, what: str) -> str:
    """The part of `now` past `sent`; a reading that rewrote what was sent (a parser bug) adds nothing."""
    if now.startswith(sent):
        return now[len(sent):]
    logger.warning("the %s changed after it was streamed; the change is not sent", what)
    return ""
