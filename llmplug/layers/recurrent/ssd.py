"""Mamba 2's state-space duality (SSD): the scan with one scalar decay per head, by chunks.

Per head h: state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T ([head_dim, state]), y_t = state_t C_t.
Inside a chunk of `chunk_size` tokens the outputs are a masked, decayed attention C_l . B_s (exact,
one batched matmul); the chunk's effect on the state is one contraction; the states at chunk
boundaries follow in order, one small step per chunk. Decays enter only as exp(cumsum_l - cumsum_s)
with s <= l, so nothing overflows. B and C are shared by the heads of a group (`n_groups`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ssd_scan", "ssd_state_update"]


def _by_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: each group's B or C for each of its heads."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over padded chunks of requests (float32 inside).

    x [R, L, H, P], dt [R, L, H] (softplus'd and clamped; 0 at padding, which then changes nothing),
    A [H], B, C [R, L, G, N], state [R, H, P, N] -> (y [R, L, H, P] without the D skip, the new state).
    """
    num_reqs, length, num_heads, head_dim = x.shape
    c = min(chunk_size, length)
    pad = -length % c
    log_decay = F.pad(dt.float() * A, (0, 0, 0, pad))  # [R, L', H]
    xdt = F.pad(x.float() * dt.float()[..., None], (0, 0, 0, 0, 0, pad))  # [R, L', H, P]
    B = F.pad(_by_head(B.float(), num_heads), (0, 0, 0, 0, 0, pad))  # [R, L', H, N]
    C = F.pad(_by_head(C.float(), num_heads), (0, 0, 0, 0, 0, pad))
    chunks = lambda t: t.unflatten(1, (-1, c))  # noqa: E731  [R, L', ...] -> [R, nc, c, ...]
    log_decay, xdt, B, C = chunks(log_decay), chunks(xdt), chunks(B), chunks(C)
    cum = log_decay.cumsum(dim=2)  # [R, nc, c, H]: log decay from the chunk's start to each token
    # inside each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(cum_l - cum_s) xdt_s
    causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    pair = (cum.unsqueeze(3) - cum.unsqueeze(2)).masked_fill(~causal[:, :, None], -torch.inf)  # [R, nc, l, s, H]
    scores = torch.einsum("rclhn,rcshn->rclsh", C, B) * pair.exp()
    y = torch.einsum("rclsh,rcshp->rclhp", scores, xdt)
    # each chunk's own contribution to the state at its end, then the states at chunk starts in order
    to_end = (cum[:, :, -1:] - cum).exp()  # [R, nc, c, H]
    chunk_states = torch.einsum("rcshn,rcsh,rcshp->rchpn", B, to_end, xdt)
    chunk_decay = cum[:, :, -1].exp()  # [R, nc, H]
    h, starts = state.float(), []
    for i in range(chunk_states.shape[1]):
        starts.append(h)
        h = h * chunk_decay[:, i, :, None, None] + chunk_states[:, i]
    start_states = torch.stack(starts, dim=1)  # [R, nc, H, P, N]
    y = y + torch.einsum("rclhn,rchpn->rclhp", C, start_states) * cum.exp()[..., None]
    return y.flatten(1, 2)[:, :length], h


def ssd_state_update(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: x [R, H, P], dt [R, H], A [H], B, C [R, G, N], state [R, H, P, N]
    -> (y [R, H, P], the new state)."""
    num_heads = x.shape[1]
    dt = dt.float()
    B, C = _by_head(B.float(), num_heads), _by_head(C.float(), num_heads)  # [R, H, N]
    decay = torch.exp(dt * A)[..., None, None]  # [R, H, 1, 1]
    h = state.float() * decay + (x.float() * dt[..., None])[..., None] * B[:, :, None, :]
    return torch.einsum("rhpn,rhn->rhp", h, C), h
