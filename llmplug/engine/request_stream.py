"""One request's outputs on the event loop's side (AsyncLLM): a queue that holds at most one unread output.

The engine makes an output per step whether or not anyone reads it. A consumer slower than the engine (an
HTTP client that stops reading its stream) would collect them without bound; instead an output that
arrives while the previous one is still unread is merged into it: deltas are concatenated (text, token ids,
logprobs), and any other output replaces the older one, since it holds everything the older one did. An
error or an abort is queued behind it, as it ends the stream.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, TypeVar

from llmplug.core.outputs import CompletionOutput, RequestOutput

T = TypeVar("T")


class RequestStream:
    """The outputs (or the error) one `AsyncLLM.generate` / `encode` call reads; `put` and `get` on `loop` only."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, delta: bool) -> None:
        self.request_id = request_id
        self.loop = loop
        self.delta = delta  # RequestOutputKind.DELTA: merged outputs concatenate
        self._items: deque[Any] = deque()
        self._ready = asyncio.Event()

    def put(self, item: Any) -> None:
        """Queue an output, an exception or an abort marker, merging an output into an unread one."""
        if self._items and isinstance(item, RequestOutput) and isinstance(self._items[-1], RequestOutput):
            self._items[-1] = merge_deltas(self._items[-1], item) if self.delta else item
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> Any:
        """The next item, waiting for one."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One DELTA output saying what `first` and then `then` said."""
    completions = {c.index: c for c in first.outputs}
    for c in then.outputs:
        before = completions.get(c.index)
        completions[c.index] = c if before is None else CompletionOutput(
            index=c.index, text=before.text + c.text, token_ids=before.token_ids + c.token_ids,
            cumulative_logprob=c.cumulative_logprob, logprobs=_concat(before.logprobs, c.logprobs),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason, error=c.error,
        )
    return RequestOutput(
        request_id=then.request_id, prompt=then.prompt, prompt_token_ids=then.prompt_token_ids,
        outputs=[completions[i] for i in sorted(completions)], finished=then.finished,
        prompt_logprobs=_concat(first.prompt_logprobs, then.prompt_logprobs), metrics=then.metrics,
        num_cached_tokens=then.num_cached_tokens,
    )


def _concat(first: list[T] | None, then: list[T] | None) -> list[T] | None:
    if first is None or then is None:
        return then if first is None else first
    return first + then
