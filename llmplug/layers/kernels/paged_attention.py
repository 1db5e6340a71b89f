"""Paged attention in one Triton launch for a whole step: prompts, chunked-prefill chunks and decodes.

Every request contributes its new queries (q_len >= 1) and attends to its first seq_len keys in the
paged cache, the query at absolute position p (= seq_len - q_len + its index) seeing keys j <= p.
The grid is (query blocks, KV heads). A program takes BLOCK_Q consecutive queries of one request
and the QUERIES_PER_KV query heads that share its KV head, i.e. BLOCK_M = BLOCK_Q * QUERIES_PER_KV
rows of one score matrix, so grouped-query attention reads each key tile once for the whole group.
It walks the request's keys in tiles of TILE_N (each key found through the block table, so tiles
may straddle cache blocks and the block size needs no relation to the tile) with an online softmax.

Request r's query blocks are numbered from query_start_loc[r] // BLOCK_Q + r: the +r leaves room for
a request whose queries do not start on a BLOCK_Q boundary, so a grid of T // BLOCK_Q + B programs
covers every request without host-side bookkeeping, and each program finds its request by a binary
search over query_start_loc. Programs past the end of their request's queries return at once.

Features, each a compile-time switch (HF semantics, scores in float32):
- sliding window w: query p sees keys j with p - w < j <= p (tiles wholly before the window are skipped);
- chunked local attention c: query p sees keys j with floor(p / c) * c <= j <= p (tiles before its chunk skipped);
- logit soft-capping c: s = c * tanh(s / c), after scaling, before masking;
- ALiBi: s += slope_h * (j - p);
- sinks: a learned logit per head that joins the softmax denominator and contributes no value.

Cache layout: key_cache and value_cache [num_blocks, block_size, num_kv_heads, head_dim].

Under triton's interpreter (tests on a CPU) both products run on float32 copies of their operands
(DOT_F32): the interpreter's tl.dot on bf16 operands returns garbage. Compiled kernels never set it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmplug.layers.kernels import interpreting, require_triton_device

__all__ = ["paged_attention"]

TILE_N = 32  # keys per iteration


@triton.jit
def _request_of(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request whose query blocks hold global block `q_block` (binary search over query_start_loc)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh from exp (no tanh in triton's core language): 1 - 2 / (e^2x + 1), exact at +-inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, alibi_slopes_ptr, sinks_ptr,
    scale, softcap, window, chunk, num_reqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, QUERIES_PER_KV: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_CHUNK: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _request_of(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_q = (q_block - (q_start // BLOCK_Q + req)) * BLOCK_Q  # this program's first query in the request
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len  # keys cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_index = first_q + rows // QUERIES_PER_KV  # [BLOCK_M] query within the request
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV  # [BLOCK_M] query head
    row_ok = q_index < q_len
    q_pos = context + q_index  # absolute position of each row's query
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    token = (q_start + q_index).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )  # [BLOCK_M, HEAD_DIM_P]
    if DOT_F32:
        q = q.to(tl.float32)

    if USE_SINKS:  # the sink is a logit already seen: running max = sink, denominator = e^0
        m_i = tl.load(sinks_ptr + head).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_slopes_ptr + head).to(tl.float32)

    kv_end = context + tl.minimum(first_q + BLOCK_Q, q_len)  # keys up to the last query's position
    first_tile = 0
    if USE_WINDOW:
        first_tile = tl.maximum(context + first_q - window + 1, 0) // TILE
    if USE_CHUNK:
        first_tile = tl.maximum(first_tile, (context + first_q) // chunk * chunk // TILE)
    for tile in range(first_tile, tl.cdiv(kv_end, TILE)):
        keys = tile * TILE + tl.arange(0, TILE)  # [TILE] key positions
        key_ok = keys < kv_end
        block = tl.load(block_tables_ptr + req * stride_bt + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        in_block = keys % BLOCK_SIZE
        k = tl.load(
            k_cache_ptr + block[None, :] * stride_kb + in_block[None, :] * stride_ks + kv_head * stride_kh
            + dims[:, None],
            mask=dim_ok[:, None] & key_ok[None, :], other=0.0,
        )  # [HEAD_DIM_P, TILE]
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE]
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if USE_ALIBI:
            s += slope[:, None] * (keys[None, :] - q_pos[:, None]).to(tl.float32)
        visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :] & row_ok[:, None]
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - keys[None, :] < window)
        if USE_CHUNK:
            visible = visible & (keys[None, :] >= q_pos[:, None] // chunk * chunk)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: no inf - inf
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + block[:, None] * stride_vb + in_block[:, None] * stride_vs + kv_head * stride_vh
            + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :], other=0.0,
        )  # [TILE, HEAD_DIM_P]
        p = p.to(v.dtype)  # the probabilities in the cache's dtype, as the tensor cores take them
        if DOT_F32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )


def block_m_for(queries_per_kv: int, max_query_len: int) -> int:
    """Rows per program: 16 (tl.dot's least) for decode-only steps, 64 when prompts bring many queries."""
    least = max(16, triton.next_power_of_2(queries_per_kv))
    return least if max_query_len == 1 else max(64, least)


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    attention_chunk: int | None = None,
) -> torch.Tensor:
    """Attend q [T, H, D] over the paged cache into out [T, H, D]; returns out.

    q and out may be strided along tokens and heads (the last dim contiguous). key_cache and
    value_cache: [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]; seq_lens [B] keys
    per request after this step; query_start_loc [B + 1] cumulative query counts; max_query_len
    (host int) chooses the program shape; alibi_slopes and sinks [H] float32.
    """
    require_triton_device(q, "paged_attention")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    if q.stride(2) != 1 or out.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("paged_attention needs head_dim contiguous in q, out and the caches")
    queries_per_kv = num_heads // num_kv_heads
    block_m = block_m_for(queries_per_kv, max_query_len)
    block_q = block_m // queries_per_kv
    num_reqs = seq_lens.shape[0]
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    dummy = seq_lens  # stands in for absent optional pointers (never read)
    _paged_attention_kernel[grid](
        out, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        dummy if alibi_slopes is None else alibi_slopes, dummy if sinks is None else sinks,
        scale, logit_softcap or 0.0, sliding_window or 0, attention_chunk or 1, num_reqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_P=max(16, triton.next_power_of_2(head_dim)), QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_SIZE=block_size, TILE=TILE_N,
        USE_WINDOW=sliding_window is not None, USE_CHUNK=attention_chunk is not None,
        USE_SOFTCAP=logit_softcap is not None,
        USE_ALIBI=alibi_slopes is not None, USE_SINKS=sinks is not None,
        # fp32 products stay fp32 (no TF32); the interpreter's bf16/fp16 dot is wrong, so it multiplies upcast
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or interpreting() else None, DOT_F32=interpreting(),
    )
    return out
