"""Mamba's selective scan: h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t . h_t, per channel.

A is diagonal per (channel, state) pair, so the recurrence is an elementwise linear scan. A prefill
runs it in blocks of `BLOCK` tokens, in order, carrying the state between blocks; inside a block one
log-depth parallel scan (Hillis-Steele: combine each step with the one 1, 2, 4, ... before it)
replaces the token loop. Every combined factor is a product of decays in (0, 1], so nothing
overflows, unlike the cumulative-sum form exp(S_t) * sum exp(-S_s) b_s. Memory: one block of
[B, BLOCK, channels, state] at a time.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "linear_scan", "selective_scan", "selective_state_update"]

BLOCK = 64


def linear_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """All h_t = a_t h_{t-1} + b_t from h_{-1} = 0, along dim 1 (a, b: [B, L, ...]), in log2(L) steps."""
    length, offset = a.shape[1], 1
    while offset < length:
        b = torch.cat([b[:, :offset], torch.addcmul(b[:, offset:], a[:, offset:], b[:, :-offset])], dim=1)
        a = torch.cat([a[:, :offset], a[:, offset:] * a[:, :-offset]], dim=1)
        offset *= 2
    return b


def selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over padded chunks (float32 inside).

    x, dt [R, L, D] (dt already softplus'd, 0 at padding so padding leaves the state alone), A [D, N],
    B, C [R, L, N], state [R, D, N] (the state before the chunk) -> (y [R, L, D], state after the chunk).
    """
    x, dt, B, C = x.float(), dt.float(), B.float(), C.float()
    h, outputs = state.float(), []
    for start in range(0, x.shape[1], BLOCK):
        part = slice(start, start + BLOCK)
        decay = torch.exp(dt[:, part, :, None] * A)  # [R, l, D, N]
        update = (dt[:, part] * x[:, part])[..., None] * B[:, part, None, :]  # [R, l, D, N]
        update[:, 0] += decay[:, 0] * h  # the carried state enters at the block's first step
        states = linear_scan(decay, update)  # [R, l, D, N]
        outputs.append(torch.einsum("rldn,rln->rld", states, C[:, part]))
        h = states[:, -1]
    return torch.cat(outputs, dim=1), h


def selective_state_update(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: x, dt [R, D], A [D, N], B, C [R, N], state [R, D, N] -> (y [R, D], new state)."""
    dt = dt.float()
    h = torch.exp(dt[..., None] * A) * state.float() + (dt * x.float())[..., None] * B.float()[:, None, :]
    return torch.einsum("rdn,rn->rd", h, C.float()), h
