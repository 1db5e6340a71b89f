"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo hybrid), by chunks.

Per value head, with state S [key_dim, value_dim]:
    S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t.
Inside a chunk the corrections u of all tokens are one lower-triangular solve (the "UT transform"
of DeltaNet): with Gamma_ts = exp(G_t - G_s) (G: cumulative log decay from the chunk's start),
    (I + strict_tril(beta_t Gamma_ts k_t . k_s)) U = beta V - beta exp(G) K S_0,
then o_t = exp(G_t) q_t S_0 + sum_{s <= t} Gamma_ts (q_t . k_s) u_s and
S_end = exp(G_c) S_0 + sum_s exp(G_c - G_s) k_s u_s^T. Chunks run in order; tokens never loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CHUNK", "chunk_gated_delta_rule", "gated_delta_rule_step", "l2_normalize"]

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the flash-linear-attention kernels' q/k norm)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _heads_first(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[R, L, Hk or Hv, ...] -> [R, Hv, L, ...] float32, q/k heads repeated for their value heads."""
    if t.dim() == 4 and t.shape[2] != num_heads:
        t = t.repeat_interleave(num_heads // t.shape[2], dim=2)
    return t.float().transpose(1, 2)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over padded chunks of requests (float32 inside).

    q, k [R, L, Hk, Dk], v [R, L, Hv, Dv], g, beta [R, L, Hv] (0 at padding: no decay, no update),
    state [R, Hv, Dk, Dv] -> (o [R, L, Hv, Dv], the new state).
    """
    length, num_heads = v.shape[1], v.shape[2]
    q, k, v, g, beta = (_heads_first(t, num_heads) for t in (q, k, v, g, beta))  # [R, Hv, L, ...]
    c = min(CHUNK, length)
    pad = -length % c
    q, k, v = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (-1, c)) for t in (q * scale, k, v))  # [R, Hv, nc, c, D]
    g, beta = (F.pad(t, (0, pad)).unflatten(2, (-1, c)) for t in (g, beta))  # [R, Hv, nc, c]
    cum = g.cumsum(-1)
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).triu()  # s >= t: not strictly before t
    gamma = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(strict.triu(1), -torch.inf).exp()  # [.., t, s]
    system = ((beta.unsqueeze(-1) * k) @ k.transpose(-1, -2) * gamma).masked_fill(strict, 0)
    system = system + torch.eye(c, device=q.device)
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    new_values = solve(beta.unsqueeze(-1) * v)  # [R, Hv, nc, c, Dv]
    decayed_keys = solve((beta * cum.exp()).unsqueeze(-1) * k)  # [R, Hv, nc, c, Dk]
    attn = q @ k.transpose(-1, -2) * gamma  # [R, Hv, nc, t, s], s <= t
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    h, outputs = state.float(), []
    for i in range(q.shape[2]):
        u = new_values[:, :, i] - decayed_keys[:, :, i] @ h  # [R, Hv, c, Dv]
        outputs.append(q_decayed[:, :, i] @ h + attn[:, :, i] @ u)
        h = h * cum[:, :, i, -1, None, None].exp() + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.cat(outputs, dim=2)[:, :, :length]  # [R, Hv, L, Dv]
    return out.transpose(1, 2), h


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: q, k [R, Hk, Dk], v [R, Hv, Dv], g, beta [R, Hv], state [R, Hv, Dk, Dv] -> (o, state)."""
    num_heads = v.shape[1]
    if q.shape[1] != num_heads:
        q, k = (t.repeat_interleave(num_heads // t.shape[1], dim=1) for t in (q, k))
    q, k, v = q.float() * scale, k.float(), v.float()
    h = state.float() * g.float().exp()[..., None, None]
    u = (v - torch.einsum("rhkv,rhk->rhv", h, k)) * beta.float()[..., None]
    h = h + k[..., None] * u[:, :, None, :]
    return torch.einsum("rhkv,rhk->rhv", h, q), h
