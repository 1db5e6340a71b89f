"""Client-controlled text made safe to log: one line, printable, bounded.

A field name or a path that a client sends ends up in the server log; raw, a newline in it forges log
lines and an 8 MB name writes an 8 MB line.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

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


class RequestLogger:
    """`--enable-log-requests`: one info line per generation request as it arrives, with its id, prompt (cut to
    `max_log_len` characters, and its token ids to as many), sampling params and LoRA adapter, as vLLM logs them.

    Off by default: prompts are the clients' data and stay out of the log unless the operator asks.
    """

    def __init__(self, max_log_len: int | None = None):
        self.max_log_len = max_log_len  # None: the whole prompt

    def log(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: Any,
            lora_request: Any = None) -> None:
        """Log one request (its prompt escaped to one line: a client cannot forge log lines)."""
        limit = self.max_log_len
        text = None if prompt is None else loggable(prompt, len(prompt) if limit is None else limit)
        ids = prompt_token_ids if limit is None else prompt_token_ids[:limit]
        adapter = None if lora_request is None else lora_request.lora_name
        logger.info("Received request %s: prompt: %s, params: %r, prompt_token_ids: %s, lora_request: %s",
                    loggable(request_id), None if text is None else f"'{text}'", params, ids, adapter)


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
