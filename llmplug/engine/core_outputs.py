"""What the engine core sends the engine process per request and step (plain Python; a pooled result is
a CPU tensor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class LogprobsLists:
    """Logprobs of N positions as lists: the chosen token first, then the top-k of the distribution."""

    logprob_token_ids: list[list[int]]  # N x (1 + k): the sampled (or prompt) token, then the top-k ids
    logprobs: list[list[float]]  # N x (1 + k)
    selected_token_ranks: list[int]  # N: rank of the chosen token (1: the most likely)

    def __len__(self) -> int:
        """N, the number of positions."""
        return len(self.selected_token_ranks)

    def tolists(self) -> "LogprobsLists":
        """Itself (LogprobsTensors has the same method, so consumers accept either)."""
        return self


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's progress in one engine step, as the output processor receives it.

    `req_id` is the engine core's request id: for n > 1 that of one child, f"{index}_{request_id}".
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id (or string) that finished it
    # Logprobs may also be LogprobsTensors: the output processor reads anything with `tolists()`.
    new_logprobs: LogprobsLists | None = None  # one position per new token
    prompt_logprobs: LogprobsLists | None = None  # the next chunk of prompt positions 1.., if requested
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # when the request first got a place in the batch
    error: str | None = None  # why the request was aborted by a failure in a step
    pooling_output: Any = None  # a pooling request's result: a CPU torch.Tensor
