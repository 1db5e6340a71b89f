"""The model runner's side of speculative decoding: verify the drafts of a step, sample the other requests."""

from __future__ import annotations

import itertools
from typing import Callable

import torch

from llmplug.engine.sampling_state import SamplingState, step_seed
from llmplug.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest
from llmplug.engine.spec_decode.rejection_sampler import RejectionSampler

UNVERIFIABLE = "its draft tokens cannot be verified: the logits hold NaN or infinity"

# sample(logits, req_ids, bitmask) -> ModelRunnerOutput: the runner's plain sampling of one row per request
PlainSampler = Callable[[torch.Tensor, list[str], "torch.Tensor | None"], ModelRunnerOutput]


class DraftVerifier:
    """Splits a step's logits rows between requests with drafts (the rejection sampler) and the rest (the sampler).

    A request with k drafts owns k + 1 consecutive rows; the others own one. A seeded request draws from a
    generator reseeded per output position, as plain sampling does, so its tokens depend only on its seed.
    """

    def __init__(self, sampling_state: SamplingState, rejection_sampler: RejectionSampler | None = None):
        self.sampling_state = sampling_state
        self.rejection_sampler = rejection_sampler or RejectionSampler()

    def verify(
        self, logits: torch.Tensor, req_ids: list[str], drafted: dict[str, ScheduledRequest], sample: PlainSampler
    ) -> ModelRunnerOutput:
        """Tokens for every request of `req_ids` (plain ones first in the output, then those with drafts:
        `drafted` holds their scheduled share, with the draft tokens and, when sampled, their distributions)."""
        drafts = {req_id: r.spec_token_ids for req_id, r in drafted.items()}
        num_rows = [len(drafts.get(r, ())) + 1 for r in req_ids]
        starts = list(itertools.accumulate(num_rows, initial=0))
        plain = [i for i, r in enumerate(req_ids) if r not in drafts]
        drafted_rows = [i for i, r in enumerate(req_ids) if r in drafts]
        # guided requests never speculate (refused when added), so no bitmask is needed for the plain rows
        output = sample(logits[[starts[i] for i in plain]], [req_ids[i] for i in plain], None) if plain else (
            ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        rows = [row for i in drafted_rows for row in range(starts[i], starts[i + 1])]
        drafted_ids = [req_ids[i] for i in drafted_rows]
        verified_logits = logits[rows]  # [sum(k + 1), V]
        finite = torch.isfinite(verified_logits).all(dim=-1).tolist()
        offset = 0
        for i, req_id in zip(drafted_rows, drafted_ids):
            if not all(finite[offset : offset + num_rows[i]]):
                output.failed[req_id] = UNVERIFIABLE  # that request alone ends
                output.corrupted.add(req_id)
            offset += num_rows[i]
        tokens = self._verify_rows(verified_logits, [drafted[r] for r in drafted_ids], finite)
        for req_id, accepted in zip(drafted_ids, tokens):
            self.sampling_state.append_output(req_id, accepted)
        output.req_ids = output.req_ids + drafted_ids
        output.sampled_token_ids = output.sampled_token_ids + tokens
        return output

    def _verify_rows(self, logits: torch.Tensor, drafted: list[ScheduledRequest], finite: list[bool]) -> list[list[int]]:
        # rows that are not finite are made harmless (their request fails anyway): the others go on
        if not all(finite):
            logits = torch.nan_to_num(logits, nan=0.0, posinf=0.0, neginf=-1e30)
        sampling, generators = [], []
        for scheduled in drafted:
            state = self.sampling_state.requests[scheduled.req_id]
            sampling.append((state.params.temperature, state.params.top_p))
            generators.append(self._generator(state, logits.device))
        return self.rejection_sampler(logits, [r.spec_token_ids for r in drafted], [r.spec_probs for r in drafted],
                                      sampling, generators)

    @staticmethod
    def _generator(state, device: torch.device) -> torch.Generator | None:
        seed = state.params.seed
        if seed is None or state.params.temperature < 1e-5:
            return None
        return torch.Generator(device=device).manual_seed(step_seed(seed, len(state.output_token_ids)))
