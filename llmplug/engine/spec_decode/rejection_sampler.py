"""The rejection sampler: which draft tokens the target model accepts, and the token that follows them.

For a request with k draft tokens the target computed k + 1 rows of logits (after the last accepted token
and after each draft). Greedy requests accept drafts while each equals the target's argmax, then take the
argmax of the first row that disagrees (or of the last row): exactly the tokens plain greedy decoding
gives. Sampled requests use speculative sampling (Leviathan et al., 2023): draft token d at a row with
target distribution p (temperature and top-p applied, as the sampler applies them) and draft distribution
q is accepted with probability min(1, p(d) / q(d)); at the first rejection the token is drawn from the
residual max(0, p - q), normalized; when all are accepted a bonus token is drawn from the last row. Each
output token then follows p exactly. Certain drafts (n-gram, greedy draft model) have q one-hot at d, so
p(d) accepts and p without d is the residual; a draft model's sampled drafts bring their q.
"""

from __future__ import annotations

import torch


def sampling_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution [n, V] the sampler draws from: softmax(logits / temperature) within the top-p nucleus.

    As the sampler defines the nucleus: the tokens whose strictly more likely tokens hold less than top_p
    of the mass (so tokens tied with the boundary belong to it), renormalized.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    ordered = probs.sort(dim=-1, descending=True).values  # [n, V]
    mass_before = ordered.cumsum(dim=-1) - ordered  # mass of the tokens ranked before each
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True)  # >= 1: the first has none before it
    boundary = ordered.gather(-1, num_kept - 1)  # [n, 1] the least probability in the nucleus
    probs = torch.where(probs >= boundary, probs, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


class RejectionSampler:
    """Verifies the draft tokens of a batch against the target's logits."""

    def __call__(
        self,
        logits: torch.Tensor,
        drafts: list[list[int]],
        draft_probs: list[torch.Tensor | None],
        sampling: list[tuple[float, float]],
        generators: list[torch.Generator | None],
    ) -> list[list[int]]:
        """The tokens each request appends: its accepted drafts and one more.

        `logits` [sum(len(d) + 1), V] holds each request's rows in order; `draft_probs` each request's draft
        distributions [len(d), V] (None: certain drafts); `sampling` its (temperature, top_p), temperature 0
        being greedy.
        """
        argmax = logits.argmax(dim=-1).tolist()  # one host read serves every greedy request
        out, row = [], 0
        for draft, q, (temperature, top_p), generator in zip(drafts, draft_probs, sampling, generators):
            rows = slice(row, row + len(draft) + 1)
            if temperature < 1e-5:
                out.append(self.verify_greedy(draft, argmax[rows]))
            else:
                p = sampling_distribution(logits[rows], temperature, top_p)  # [k + 1, V]
                out.append(self.verify_sampled(draft, p, q, generator))
            row = rows.stop
        return out

    @staticmethod
    def verify_greedy(draft: list[int], target: list[int]) -> list[int]:
        """Drafts up to the first that is not the target's argmax, then the argmax there."""
        accepted = 0
        while accepted < len(draft) and draft[accepted] == target[accepted]:
            accepted += 1
        return draft[:accepted] + [target[accepted]]

    def verify_sampled(
        self, draft: list[int], p: torch.Tensor, q: torch.Tensor | None, generator: torch.Generator | None
    ) -> list[int]:
        """Speculative sampling of one request: target rows `p` [k + 1, V], draft rows `q` [k, V] or None (one-hot)."""
        uniforms = torch.rand(len(draft), generator=generator, device=p.device).tolist()
        for i, token in enumerate(draft):
            q_i = None if q is None else q[i]
            if uniforms[i] >= self.accept_probability(p[i], q_i, token):
                return draft[:i] + [_draw(self.residual(p[i], q_i, token), generator)]
        return draft + [_draw(p[-1], generator)]

    @staticmethod
    def accept_probability(p: torch.Tensor, q: torch.Tensor | None, token: int) -> float:
        """min(1, p(d) / q(d)) for draft token d; q None: one-hot at d, so p(d)."""
        if q is None:
            return float(p[token])
        return min(1.0, float(p[token] / q[token]))

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
        """max(0, p - q) (normalized by the draw); q None: one-hot at d, so p without d."""
        if q is not None:
            return (p - q).clamp_(min=0.0)
        residual = p.clone()
        residual[token] = 0.0
        return residual


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn in proportion to `weights` [V] (need not sum to 1)."""
    return int(torch.multinomial(weights, 1, generator=generator))
