"""The rejection sampler: which draft tokens the target model accepts, and the token that follows them.

For a request with k draft tokens the target computed k + 1 rows of logits (after the last accepted token
and after each draft). Greedy requests accept drafts while each equals the target's argmax, then take the
argmax of the first row that disagrees (or of the last row): exactly the tokens plain greedy decoding
gives. Sampled requests use speculative sampling (Leviathan et al., 2023): draft token d at a row with
target distribution p (temperature applied) and draft distribution q is accepted with probability
min(1, p(d) / q(d)); at the first rejection the token is drawn from the residual max(0, p - q), normalized;
when all are accepted a bonus token is drawn from the last row. Each output token then follows p exactly.
N-gram drafts are certain (q is one-hot at d), so p(d) accepts and p without d is the residual.
"""

from __future__ import annotations

import torch


class RejectionSampler:
    """Verifies the draft tokens of a batch against the target's logits."""

    def __call__(
        self,
        logits: torch.Tensor,
        drafts: list[list[int]],
        temperatures: list[float],
        generators: list[torch.Generator | None],
    ) -> list[list[int]]:
        """The tokens each request appends: its accepted drafts and one more.

        `logits` [sum(len(d) + 1), V] holds each request's rows in order; temperature 0 is greedy.
        """
        argmax = logits.argmax(dim=-1).tolist()  # one host read serves every greedy request
        out, row = [], 0
        for draft, temperature, generator in zip(drafts, temperatures, generators):
            rows = slice(row, row + len(draft) + 1)
            if temperature < 1e-5:
                out.append(self.verify_greedy(draft, argmax[rows]))
            else:
                probs = torch.softmax(logits[rows].float() / temperature, dim=-1)  # [k + 1, V]
                out.append(self.verify_sampled(draft, probs, generator))
            row = rows.stop
        return out

    @staticmethod
    def verify_greedy(draft: list[int], target: list[int]) -> list[int]:
        """Drafts up to the first that is not the target's argmax, then the argmax there."""
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        return draft[:accepted] + [target[accepted]]

    def verify_sampled(self, draft: list[int], probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
        """Speculative sampling of one request's rows `probs` [k + 1, V] (one-hot draft distributions)."""
        uniforms = torch.rand(len(draft), generator=generator, device=probs.device).tolist()
        for i, token in enumerate(draft):
            if uniforms[i] >= self.accept_probability(probs[i], token):
                return draft[:i] + [_draw(self.residual(probs[i], token), generator)]
        return draft + [_draw(probs[-1], generator)]

    @staticmethod
    def accept_probability(p: torch.Tensor, token: int) -> float:
        """min(1, p(d) / q(d)) with q one-hot at the draft token d."""
        return float(p[token])

    @staticmethod
    def residual(p: torch.Tensor, token: int) -> torch.Tensor:
        """max(0, p - q) with q one-hot at d: p without d (normalized by the draw)."""
        residual = p.clone()
        residual[token] = 0.0
        return residual


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn in proportion to `weights` [V] (need not sum to 1)."""
    return int(torch.multinomial(weights, 1, generator=generator))
