"""Plain-torch references of the Triton kernels: what each kernel must compute, written for clarity.

Each reference computes in float32, one request or row at a time where that is clearer, with none
of the kernels' tiling; the tests and `benchmarks/gpu_check.py` compare the kernels against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "moe_align_block_size_ref",
    "paged_attention_ref",
    "reshape_and_cache_ref",
    "rms_norm_ref",
    "rotary_ref",
    "silu_and_mul_ref",
    "token_bitmask_ref",
]


def _request_keys(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len keys (or values) of one request: cache [num_blocks, bs, Hkv, D] -> [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    needed = -(-seq_len // block_size)
    return cache[blocks[:needed].long()].flatten(0, 1)[:seq_len]


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, num_experts: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, offsets, counts) of `moe_align_block_size`, one expert at a time: expert e's flat
    assignment indices in ascending order, padded with T * k up to a multiple of block_size."""
    flat = topk_ids.reshape(-1)
    numel = flat.numel()
    sorted_ids = torch.full((numel + num_experts * (block_size - 1),), numel, dtype=torch.int32)
    offsets, counts = [0], []
    for e in range(num_experts):
        members = (flat == e).nonzero().flatten()  # ascending
        start = offsets[-1]
        sorted_ids[start : start + len(members)] = members.int()
        counts.append(len(members))
        offsets.append(start + -(-len(members) // block_size) * block_size)
    return sorted_ids, torch.tensor(offsets, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32)


def paged_attention_ref(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] (requests one after another, query_lens each) over the paged cache -> [T, H, D] float32."""
    num_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    outputs, start = [], 0
    for r, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        queries = q[start : start + q_len].float()  # [q, H, D]
        start += q_len
        keys = _request_keys(key_cache, block_tables[r], seq_len).float()  # [s, Hkv, D]
        values = _request_keys(value_cache, block_tables[r], seq_len).float()
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [s, H, D]: query head h uses KV head h // G
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale  # [H, q, s]
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]  # [q, 1]
        key_pos = torch.arange(seq_len)[None, :]  # [1, s]
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float()[:, None, None] * (key_pos - query_pos)
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= query_pos - key_pos < sliding_window
        if attention_chunk is not None:
            visible &= key_pos // attention_chunk == query_pos // attention_chunk
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # one more logit per head that takes probability mass and adds no value
            sink = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, values))
    return torch.cat(outputs)


def reshape_and_cache_ref(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Token t's k, v [T, Hkv * D] go to slot_mapping[t] of the caches [num_blocks, block_size, Hkv, D]."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    for t, slot in enumerate(slot_mapping.tolist()):
        key_cache[slot // block_size, slot % block_size] = k[t].view(num_kv_heads, head_dim)
        value_cache[slot // block_size, slot % block_size] = v[t].view(num_kv_heads, head_dim)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + residual) / rms * weight in float32, and the sum x + residual (in x's dtype) when residual is given."""
    summed = None
    if residual is not None:
        summed = x + residual
        x = summed
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed * weight.float(), summed


def rotary_ref(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox_style: bool
) -> torch.Tensor:
    """x [T, heads, D] rotated by the angles of `positions` [T]; cos_sin_cache [P, rotary_dim] = cos | sin.

    Neox style pairs dim i with i + rotary_dim / 2, interleaved style pairs 2i with 2i + 1; dims past
    rotary_dim pass through. Float32 result.
    """
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    cos, sin = cos_sin_cache[positions].float().split(half, dim=-1)  # [T, half] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x.float().clone()
    rot = out[..., :rotary_dim]
    if is_neox_style:
        x1, x2 = rot[..., :half].clone(), rot[..., half:].clone()
        rot[..., :half], rot[..., half:] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    else:
        x1, x2 = rot[..., 0::2].clone(), rot[..., 1::2].clone()
        rot[..., 0::2], rot[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] [..., 2d] -> [..., d] float32."""
    gate, up = x.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with -inf where bit (t % 32) of word t // 32 of the row's bitmask [B, W] int32 is 0
    (tokens past 32 W are disallowed)."""
    tokens = torch.arange(logits.shape[1], device=logits.device)
    words = bitmask[:, (tokens // 32).clamp(max=bitmask.shape[1] - 1)]  # [B, V] the word holding each token's bit
    allowed = ((words >> (tokens % 32)) & 1).bool() & (tokens // 32 < bitmask.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))
