"""What a proposer is asked for (a request's tokens and how it samples) and what it returns (a draft)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llmplug.core.params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, frozen=True)
class DraftRequest:
    """One speculating request's share of a proposal: draft up to `num_tokens` tokens after `token_ids`."""

    req_id: str
    token_ids: list[int]
    num_tokens: int
    params: SamplingParams  # a sampled request's drafts may be sampled with its temperature and top-p


@dataclass(slots=True, frozen=True)
class Draft:
    """Draft tokens and, when they were sampled, the distributions they were sampled from."""

    token_ids: list[int]
    # [len(token_ids), V]: the draft distribution q of each position; None: the drafts are certain (n-gram,
    # greedy), i.e. q is one-hot at each draft token
    probs: torch.Tensor | None = None

    def truncated(self, num_tokens: int) -> Draft:
        """The first `num_tokens` drafts (and their distributions)."""
        if num_tokens >= len(self.token_ids):
            return self
        num_tokens = max(num_tokens, 0)
        probs = None if self.probs is None else self.probs[:num_tokens]
        return replace(self, token_ids=self.token_ids[:num_tokens], probs=probs)


NO_DRAFT = Draft([])
