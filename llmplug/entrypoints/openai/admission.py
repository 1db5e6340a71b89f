"""Admission control: a cap on the requests that wait for a place in the engine's running batch.

Without a cap a burst of clients queues without bound: memory grows, and every waiting client's
latency with it. Past the cap the server answers 503 with `Retry-After`, which OpenAI clients honour
by retrying later. Counted in sequences (a request with `n` completions is `n` sequences, as the
scheduler counts them): waiting = sequences this server has handed to the engine and not seen end,
minus those in the running batch after the engine's latest step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from llmplug.core.errors import ConfigError
from llmplug.entrypoints.openai.errors import OpenAIError

# Seconds a client is told to wait after a 503: about the time a step frees places in the batch.
RETRY_AFTER_S = 1


class AdmissionControl:
    """Admits a request only while fewer than `max_waiting` sequences wait for the running batch.

    Used from one event loop only (no lock): `admit` checks and counts with no await in between.
    """

    def __init__(self, max_waiting: int, num_running: Callable[[], int]):
        if max_waiting < 1:  # a new request waits at least until the next step: 0 would refuse every one
            raise ConfigError(f"max_waiting_requests={max_waiting}: must be at least 1")
        self.max_waiting = max_waiting
        self.num_running = num_running  # sequences in the running batch, as of the engine's latest step
        self.in_flight = 0  # sequences admitted and not yet ended

    @property
    def num_waiting(self) -> int:
        """Sequences admitted that are not in the running batch."""
        return max(self.in_flight - self.num_running(), 0)

    @contextlib.contextmanager
    def admit(self, num_sequences: int) -> Iterator[None]:
        """Count `num_sequences` (every engine request the request creates: n x prompts, pooling inputs) as in
        flight while the block runs; 503 when they do not fit in the waiting queue. An empty queue takes any
        one request: its size is bounded by the request caps (request_caps.py), and it must be able to run."""
        if self.num_waiting and self.num_waiting + num_sequences > self.max_waiting:
            raise OpenAIError(
                503, f"The server is busy: {self.num_waiting} requests are waiting for the running batch (the limit "
                     f"is {self.max_waiting}); retry in {RETRY_AFTER_S} s.",
                code="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += num_sequences
        try:
            yield
        finally:
            self.in_flight -= num_sequences
