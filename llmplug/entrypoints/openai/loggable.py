"""Client-controlled text made safe to log: one line, printable, bounded.

A field name or a path that a client sends ends up in the server log; raw, a newline in it forges log
lines and an 8 MB name writes an 8 MB line.
"""

from __future__ import annotations

MAX_CHARS = 80  # of one piece of client text in a log line
MAX_ITEMS = 20  # pieces of client text listed in one log line


def loggable(text: str, limit: int = MAX_CHARS) -> str:
    """`text` cut to `limit` characters, non-printable characters (newlines, escapes) written as \\x.. / \\u...."""
    cut = text[:limit]
    safe = "".join(c if c.isprintable() else _escape(c) for c in cut)
    return safe if len(text) <= limit else f"{safe}... ({len(text) - limit} more characters)"


def loggable_list(texts: list[str]) -> str:
    """Up to MAX_ITEMS of `texts`, each `loggable`, comma-separated, with how many were left out."""
    shown = ", ".join(loggable(t) for t in texts[:MAX_ITEMS])
    return shown if len(texts) <= MAX_ITEMS else f"{shown} (and {len(texts) - MAX_ITEMS} more)"


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
