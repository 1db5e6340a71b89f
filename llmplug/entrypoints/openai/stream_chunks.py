"""The server-sent event of the chunk a stream sends most: one choice's next text, and nothing else new.

A streamed answer sends one chunk per token, nearly all of them the same JSON object but for the text. Building
its three pydantic models and serializing them took 12 us of the event loop per token (1.6 us here), time that the
engine thread, waiting for the GIL, and the client, waiting for a core, share. `TextChunks` writes the model's own JSON once,
with a marker where the text goes, and fills in each chunk's text with `json.dumps`: the bytes are those of
`model_dump_json` (both escape `"`, `\\` and the control characters alone, in the same forms).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from llmplug.entrypoints.openai.serving_engine import sse

_MARKER = "llmplug-stream-text-marker"
# json.dumps(text, ensure_ascii=False) builds an encoder per call (2.2 us); this one is built once (0.2 us)
_encode_text = json.JSONEncoder(ensure_ascii=False).encode


class TextChunks:
    """The SSE event of a chunk whose only varying part is a text: `chunks(text)`.

    `dump(text)` is the chunk's JSON with that text, as the models write it; it is called once, with a marker.
    """

    def __init__(self, dump: Callable[[str], str]) -> None:
        parts = sse(dump(_MARKER)).split(json.dumps(_MARKER))
        if len(parts) != 2:
            raise ValueError("the chunk's JSON must hold its text exactly once")
        self._prefix, self._suffix = parts

    def __call__(self, text: str) -> str:
        return self._prefix + _encode_text(text) + self._suffix
