"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's tail."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from llmplug.engine.spec_decode.draft import Draft, DraftRequest


class NgramProposer:
    """Drafts by prompt lookup: the longest tail of `prompt_lookup_max` down to `prompt_lookup_min` tokens that
    occurred before in the sequence (prompt and output) is continued as it was continued then."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Each request's lookup (certain drafts: a continuation seen before, whatever the request samples)."""
        return [Draft(self.lookup(r.token_ids, r.num_tokens)) for r in requests]

    def lookup(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` draft tokens to follow `token_ids` (none when no tail occurred before)."""
        if num_tokens <= 0:
            return []
        tokens = np.asarray(token_ids)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows that end before the last token: the tail itself is not an earlier occurrence
            windows = sliding_window_view(tokens[:-1], n)  # [len - n, n]
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start : start + num_tokens].tolist()
        return []

    def shutdown(self) -> None:
        """Nothing to release: the lookup holds no state."""
