"""What the scheduler asks of speculative decoding: draft tokens for a decoding request, and the counts."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from llmplug.core.config import SpeculativeConfig
from llmplug.core.params import SamplingParams
from llmplug.engine.request import Request
from llmplug.engine.spec_decode.draft import Draft, DraftRequest
from llmplug.engine.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    """Proposes draft tokens: n-gram prompt lookup or a draft model."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One draft per request, of up to its `num_tokens` tokens likely to follow its `token_ids`.

        Called by the scheduler once a step with every decoding request that may speculate, so that a
        model-based proposer runs one batched forward per draft position.
        """

    def shutdown(self) -> None:
        """Release what the proposer holds (a draft model's engine)."""


def can_speculate(params: SamplingParams) -> bool:
    """True for greedy sampling, or sampling with temperature and top-p: nothing that reshapes the
    distribution per position (the rejection sampler applies temperature and top-p to every verified row).

    Penalties, logit bias, allowed or banned tokens, min_tokens, logits processors and top-k/min-p
    would have to be applied to every verified position as if the drafts before it were already appended,
    and logprobs would be wanted for every accepted token; such a request decodes one token a step, in
    the same batch as the speculating ones. Guided decoding is refused when the request is added.
    """
    return (
        params.logprobs is None and params.top_k is None and params.min_p == 0.0
        and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0 and params.repetition_penalty == 1.0
        and not params.logit_bias and params.allowed_token_ids is None and not params.bad_words
        and params.min_tokens == 0 and not params.logits_processors and params.guided_decoding is None
    )


class RunnerDrafts:
    """The proposer of methods whose drafts the model runner computes (EAGLE): each step's runner output
    carries the drafts of every request that sampled, for its next step."""

    def __init__(self) -> None:
        self.latest: dict[str, list[int]] = {}

    def receive(self, drafts: dict[str, list[int]]) -> None:
        """The last step's drafts (they replace the older ones: a request drafts anew every step)."""
        self.latest = drafts

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """The runner's drafts of each request, cut to its room."""
        return [Draft(self.latest.get(r.req_id, [])[: r.num_tokens]) for r in requests]

    def shutdown(self) -> None:
        """Nothing to release: the head lives in the model runner."""


@dataclass(slots=True)
class SpecDecodeStats:
    """Draft tokens proposed and accepted since start (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted drafts by their position in the draft (0: first); acceptance stops at the first rejection
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed draft token (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a speculating request gains per step: its accepted drafts plus the one the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """Proposes the draft tokens of decoding requests (n-gram by default) and counts how many are accepted."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self._stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * self.num_speculative_tokens)

    def propose(self, requests: list[tuple[Request, int]]) -> dict[str, Draft]:
        """Drafts of at most `room` (and num_speculative_tokens) tokens for each (request, room) that can
        speculate, in one call of the proposer; requests without any draft are left out."""
        asking = [(r, room) for r, room in requests if room > 0 and can_speculate(r.sampling_params)]
        if not asking:
            return {}
        asks = [DraftRequest(r.request_id, r.all_token_ids, min(self.num_speculative_tokens, room), r.sampling_params)
                for r, room in asking]
        drafts = self.proposer.propose(asks)
        return {r.request_id: d for (r, _), d in zip(asking, drafts) if d.token_ids}

    def receive(self, drafts: dict[str, list[int]]) -> None:
        """The drafts the model runner proposed in the last step (a runner-side method: EAGLE)."""
        if drafts:
            self.proposer.receive(drafts)

    def record(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verified request-step."""
        self._stats.num_drafts += 1
        self._stats.num_draft_tokens += num_draft_tokens
        self._stats.num_accepted_tokens += num_accepted_tokens
        per_pos = self._stats.num_accepted_tokens_per_pos
        if num_accepted_tokens > len(per_pos):  # a proposer that drafted past num_speculative_tokens
            per_pos.extend([0] * (num_accepted_tokens - len(per_pos)))
        for pos in range(num_accepted_tokens):  # the accepted drafts are the first num_accepted_tokens
            per_pos[pos] += 1

    def shutdown(self) -> None:
        """Release the proposer."""
        self.proposer.shutdown()

    @property
    def stats(self) -> SpecDecodeStats:
        """A snapshot of the counters."""
        return replace(self._stats, num_accepted_tokens_per_pos=list(self._stats.num_accepted_tokens_per_pos))
