"""TorchSDPABackend: paged attention in plain PyTorch, a few batched ops per layer and step.

Cache layout: [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]. One `index_select` of
whole blocks gathers K and V of the whole batch, and leaves each (request, KV head) matrix
[seq, head_dim] contiguous, which is what batched matmuls want.

A step is split into at most two parts:

- decode part: requests with one new token and a cached context. The G query heads that share a
  KV head become G query rows of one [G, seq] score matrix, so grouped-query attention needs no
  K/V expansion and no causal mask; scores, softmax and the weighted sum are three batched ops
  over (KV head, request) — for a handful of query rows this beats SDPA's flash kernel on CPU.
  The contexts come from the layer's decode mirror (`decode_mirror.py`): gathered from the cache
  when the decode batch changes, then only extended by each step's new token.
- prefill part: every other request (prompts, chunked-prefill chunks, prefix-cache hits, 1-token
  prompts), one `scaled_dot_product_attention` call: queries padded to [B, max_query_len], keys
  gathered from the cache, and a mask that lets query i of a request with c cached tokens see
  keys j <= c + i. Prompts with nothing cached take their keys from the step's own k/v instead of
  the cache, and a single such prompt skips padding and mask: plain causal SDPA.

Everything that depends only on the batch (gather indexes, masks, the gather buffer) is built once
per step and shared by every layer; a layer only writes its k/v, gathers (or appends to its
mirror), and attends. Every layer writes all of the step's k/v into its cache before it reads any:
a request may read a shared block that another request of the same step writes.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from llmplug.layers.attention.backend import AttentionBackend
from llmplug.layers.attention.decode_mirror import DecodeMirror, DecodeRows, mirror_fits
from llmplug.layers.forward_context import CommonAttentionMetadata

if TYPE_CHECKING:
    from llmplug.layers.attention.layer import Attention

__all__ = ["DecodePart", "PrefillPart", "TokenSelection", "TorchSDPABackend", "TorchSDPAMetadata"]


@dataclass(slots=True, frozen=True)
class TokenSelection:
    """The step's tokens of one part: a contiguous range (viewed, no copy) or an index."""

    start: int
    stop: int
    index: torch.Tensor | None = None  # [n] int64 when the part's tokens are not contiguous

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of x [T, ...] that belong to the part."""
        return x[self.start : self.stop] if self.index is None else x.index_select(0, self.index)

    def put(self, out: torch.Tensor, rows: torch.Tensor) -> None:
        """Write the part's result rows back into out [T, ...]."""
        if self.index is None:
            out[self.start : self.stop] = rows
        else:
            out.index_copy_(0, self.index, rows)


@dataclass(slots=True)
class DecodePart:
    """Requests with one new token attending to their whole cached context."""

    tokens: TokenSelection
    num_reqs: int
    block_index: torch.Tensor  # [num_reqs * blocks_per_req] cache blocks to gather, request after request
    kv_len: int  # blocks_per_req * block_size keys per request after the gather
    key_mask: torch.Tensor | None  # [B, kv_len] bool, True for real keys; None if all are real
    rows: DecodeRows  # what a layer's decode mirror records of this step
    _masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    _buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(default_factory=dict)
    _append_index: torch.Tensor | None = None

    @property
    def append_index(self) -> torch.Tensor:
        """[B] row of each request's new key in a mirror viewed as [2, Hkv, B * kv_len, D] (built once)."""
        if self._append_index is None:
            device = self.block_index.device
            newest = torch.tensor(self.rows.seq_lens, device=device) - 1
            self._append_index = torch.arange(self.num_reqs, device=device) * self.kv_len + newest
        return self._append_index

    def score_mask(self, num_kv_heads: int, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive key mask [Hkv * B, G, kv_len] in `dtype`, laid out like the scores (built once per step)."""
        key = (num_kv_heads, group, dtype)
        if key not in self._masks:
            device = self.block_index.device
            if self.key_mask is None:  # zeros: baddbmm still needs an addend, and this costs one step-wide alloc
                mask = torch.zeros(self.num_reqs, self.kv_len, dtype=dtype, device=device)
            else:
                mask = _additive(self.key_mask, dtype)  # [B, kv_len]
            expanded = mask[None, :, None, :].expand(num_kv_heads, -1, group, -1)
            self._masks[key] = expanded.reshape(num_kv_heads * self.num_reqs, group, self.kv_len)
        return self._masks[key]

    def gather_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scratch tensor for the gathered K/V, allocated once per step and reused by every layer."""
        key = (shape, dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return self._buffers[key]


@dataclass(slots=True)
class PrefillPart:
    """Requests with several new tokens (or a 1-token prompt), padded to max_query_len queries each."""

    tokens: TokenSelection
    num_reqs: int
    max_query_len: int
    has_context: bool  # some request has tokens cached before this step (chunked prefill, prefix hit)
    causal_single: bool  # one request, nothing cached: plain causal attention over the step's k/v
    block_index: torch.Tensor | None = None  # [num_reqs * blocks_per_req]
    kv_len: int = 0
    q_pad_index: torch.Tensor | None = None  # [B * max_query_len] part-local token of each padded query row
    out_index: torch.Tensor | None = None  # [num_part_tokens] padded row of each part-local token
    causal_mask: torch.Tensor | None = None  # [B, 1, max_query_len, kv_len] bool: j <= context + i, j < seq_len
    _float_masks: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    def attn_mask(self, dtype: torch.dtype, kv_len: int) -> torch.Tensor:
        """The causal mask over the first kv_len keys, additive in `dtype` (built once per step)."""
        key = (dtype, kv_len)
        if key not in self._float_masks:
            self._float_masks[key] = _additive(self.causal_mask[..., :kv_len], dtype)
        return self._float_masks[key]


@dataclass(slots=True)
class TorchSDPAMetadata:
    """One step's metadata for TorchSDPABackend."""

    slot_mapping: torch.Tensor  # [T] cache slot of each token
    num_tokens: int
    decode: DecodePart | None
    prefill: PrefillPart | None


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean keep-mask -> 0 / -inf additive mask (SDPA would otherwise convert it on every call)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _select_tokens(reqs: list[int], starts: list[int], device: torch.device) -> TokenSelection:
    """The tokens of requests `reqs` given each request's first token (starts has B + 1 entries)."""
    first, last = reqs[0], reqs[-1]
    if last - first + 1 == len(reqs):  # consecutive requests own a contiguous token range
        return TokenSelection(starts[first], starts[last + 1])
    req_starts = torch.tensor([starts[r] for r in reqs], device=device)
    q_lens = torch.tensor([starts[r + 1] - starts[r] for r in reqs], device=device)
    local_starts = torch.cumsum(q_lens, 0) - q_lens
    num = int(sum(starts[r + 1] - starts[r] for r in reqs))
    index = torch.arange(num, device=device) + torch.repeat_interleave(req_starts - local_starts, q_lens)
    return TokenSelection(0, num, index)


def _request_blocks(common: CommonAttentionMetadata, reqs: list[int], max_seq_len: int) -> tuple[torch.Tensor, int]:
    """Block tables [len(reqs), blocks_per_req] covering max_seq_len keys of each request, and that key count."""
    num_blocks = -(-max_seq_len // common.block_size)
    if common.block_tables.shape[1] < num_blocks:
        raise ValueError(
            f"block_tables has {common.block_tables.shape[1]} columns but a request holds {max_seq_len} tokens "
            f"({num_blocks} blocks of {common.block_size}): the model runner must pass every request's blocks"
        )
    tables = common.block_tables
    if len(reqs) != common.num_reqs:
        tables = tables.index_select(0, torch.tensor(reqs, device=tables.device))
    return tables[:, :num_blocks], num_blocks * common.block_size


def _build_decode(
    common: CommonAttentionMetadata, reqs: list[int], starts: list[int], seq_lens: list[int]
) -> DecodePart:
    """Gather index and key-length mask of the decode requests."""
    device = common.slot_mapping.device
    lens = [seq_lens[r] for r in reqs]
    tables, kv_len = _request_blocks(common, reqs, max(lens))
    key_mask = None
    if any(n != kv_len for n in lens):
        lens_t = torch.tensor(lens, device=device)
        key_mask = torch.arange(kv_len, device=device)[None, :] < lens_t[:, None]  # [B, kv_len]
    rows = DecodeRows(tables, tuple(lens), common.block_size)
    tokens = _select_tokens(reqs, starts, device)
    return DecodePart(tokens, len(reqs), tables.reshape(-1), kv_len, key_mask, rows)


def _build_prefill(
    common: CommonAttentionMetadata, reqs: list[int], starts: list[int], q_lens: list[int], seq_lens: list[int]
) -> PrefillPart:
    """Padding indexes and causal mask of the prefill requests."""
    device = common.slot_mapping.device
    part_q, part_seq = [q_lens[r] for r in reqs], [seq_lens[r] for r in reqs]
    has_context = any(s > q for q, s in zip(part_q, part_seq))
    part = PrefillPart(
        _select_tokens(reqs, starts, device), len(reqs), max(part_q), has_context, len(reqs) == 1 and not has_context
    )
    if part.causal_single:
        return part
    tables, part.kv_len = _request_blocks(common, reqs, max(part_seq))
    part.block_index = tables.reshape(-1)
    q_len_t, seq_t = torch.tensor(part_q, device=device), torch.tensor(part_seq, device=device)
    part.q_pad_index, part.out_index = _padding_indexes(q_len_t, part.max_query_len)
    part.causal_mask = _causal_mask(q_len_t, seq_t, part.max_query_len, part.kv_len)
    return part


def _padding_indexes(q_lens: torch.Tensor, max_query_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(part-local token of each padded query row [B * Qm], padded row of each token [sum(q_lens)])."""
    device = q_lens.device
    local_starts = torch.cumsum(q_lens, 0) - q_lens
    i = torch.arange(max_query_len, device=device)
    # padded rows repeat the request's last query; their output is never read
    q_pad_index = (local_starts[:, None] + torch.minimum(i[None, :], q_lens[:, None] - 1)).reshape(-1)
    row_of_first = torch.arange(q_lens.shape[0], device=device) * max_query_len - local_starts
    out_index = torch.repeat_interleave(row_of_first, q_lens) + torch.arange(int(q_lens.sum()), device=device)
    return q_pad_index, out_index


def _causal_mask(q_lens: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, kv_len: int) -> torch.Tensor:
    """[B, 1, Qm, kv_len] bool: query i (absolute position seq_len - q_len + i) sees keys j <= its position.

    Padded rows (i >= q_len) see every real key, so no row is fully masked (no NaN).
    """
    device = q_lens.device
    i = torch.arange(max_query_len, device=device)
    j = torch.arange(kv_len, device=device)
    query_pos = (seq_lens - q_lens)[:, None, None] + i[None, :, None]  # [B, Qm, 1]
    mask = (j[None, None, :] <= query_pos) & (j[None, None, :] < seq_lens[:, None, None])  # [B, Qm, kv_len]
    return mask.unsqueeze(1)


def _adjacent_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k and v [T, W] as one [T, 2, W] view when v's columns follow k's in the same rows (a fused qkv
    output), so that both are stored by one copy; None otherwise."""
    num_tokens, width = k.shape
    if v.shape != k.shape or v.stride() != k.stride() or k.stride(1) != 1:
        return None
    if v.data_ptr() != k.data_ptr() + width * k.element_size():
        return None
    # one storage, so the view below stays inside it (`_base` is not tracked under inference_mode)
    if v.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    return k.as_strided((num_tokens, 2, width), (k.stride(0), width, 1))


def _scatter_kv(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
    """Store k, v [T, Hkv * D] at rows `index` [T] of rows [2 (K, V), Hkv, num_rows, D]."""
    num_kv_heads, head_dim = rows.shape[1], rows.shape[-1]
    kv = _adjacent_kv(k, v)
    if kv is not None:
        rows.index_copy_(2, index, kv.view(-1, 2, num_kv_heads, head_dim).permute(1, 2, 0, 3))
        return
    rows[0].index_copy_(1, index, k.view(-1, num_kv_heads, head_dim).transpose(0, 1))
    rows[1].index_copy_(1, index, v.view(-1, num_kv_heads, head_dim).transpose(0, 1))


def _write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's k, v [T, Hkv * D] at their slots of cache [2, Hkv, num_blocks, block_size, D]."""
    _scatter_kv(cache.view(2, cache.shape[1], -1, cache.shape[-1]), k, v, slot_mapping)


def _gather_blocks(cache: torch.Tensor, block_index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[2, Hkv, len(block_index), block_size, D]: the listed blocks of K and V, request after request."""
    if out is None:
        return cache.index_select(2, block_index)
    return torch.index_select(cache, 2, block_index, out=out)


def _decode_kv(
    layer: "Attention", k: torch.Tensor, v: torch.Tensor, part: DecodePart, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode requests' keys, transposed, and values, this step's included.

    -> keys [Hkv * B, D, kv_len], values [Hkv * B, kv_len, D]; batch index = kv_head * B + request.
    From the layer's mirror when it holds the previous step of the same requests (append the new
    k, v [B, Hkv * D]); else gathered from the cache (already holding this step's k, v) into the
    mirror, or into a scratch buffer when a mirror would take too much memory.
    """
    shape = (2, layer.num_kv_heads, part.num_reqs, part.kv_len, layer.head_dim)
    if not mirror_fits(part.num_reqs, part.kv_len, cache):
        layer.backend_state = None
        blocks_shape = (2, shape[1], part.block_index.shape[0], *cache.shape[3:])
        blocks = _gather_blocks(cache, part.block_index, part.gather_buffer(blocks_shape, cache.dtype, cache.device))
        batched = blocks.view(2, shape[1] * shape[2], shape[3], shape[4])
        return batched[0].transpose(1, 2), batched[1]
    mirror = layer.backend_state
    if isinstance(mirror, DecodeMirror) and part.rows.extends(mirror.rows):
        _scatter_kv(mirror.key_rows, k, v, part.append_index)
    else:
        if not isinstance(mirror, DecodeMirror) or mirror.kv.shape != shape:  # else regather in place
            mirror = DecodeMirror(torch.empty(shape, dtype=cache.dtype, device=cache.device), part.rows)
            layer.backend_state = mirror
        _gather_blocks(cache, part.block_index, mirror.kv.view(2, shape[1], -1, *cache.shape[3:]))
    mirror.rows = part.rows
    return mirror.keys_t, mirror.values


def _decode(
    layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: DecodePart, cache: torch.Tensor
) -> torch.Tensor:
    """q, k, v [B, heads * D] of one token per request over each request's cached keys -> [B, H * D]."""
    b, hkv, g, d = part.num_reqs, layer.num_kv_heads, layer.num_queries_per_kv, layer.head_dim
    keys_t, values = _decode_kv(layer, k, v, part, cache)  # [Hkv * B, D, kv_len], [Hkv * B, kv_len, D]
    qh = q.view(b, hkv, g, d).transpose(0, 1).reshape(hkv * b, g, d)  # [Hkv * B, G, D]
    scores = torch.baddbmm(part.score_mask(hkv, g, q.dtype), qh, keys_t, alpha=layer.scale)  # [Hkv * B, G, kv_len]
    out = torch.bmm(torch.softmax(scores, dim=-1), values)  # [Hkv * B, G, D]
    return out.view(hkv, b, g, d).transpose(0, 1).reshape(b, layer.num_heads * d)  # heads in order kv * G + g


def _causal_single(layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One prompt with nothing cached: causal attention over its own q, k, v [T, heads * D] -> [T, H * D]."""
    t, d = q.shape[0], layer.head_dim
    qh = q.view(1, t, layer.num_heads, d).transpose(1, 2)  # [1, H, T, D]
    kh = k.view(1, t, layer.num_kv_heads, d).transpose(1, 2)  # [1, Hkv, T, D]
    vh = v.view(1, t, layer.num_kv_heads, d).transpose(1, 2)
    gqa = layer.num_kv_heads != layer.num_heads
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=layer.scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(t, layer.num_heads * d)


def _own_kv(
    layer: "Attention", k: torch.Tensor, v: torch.Tensor, part: PrefillPart
) -> tuple[torch.Tensor, torch.Tensor]:
    """The part's own k, v padded like the queries -> [B, Hkv, Qm, D] each (nothing cached, or no cache)."""
    if part.has_context:
        raise RuntimeError("a request with cached context was scheduled but the Attention layer has no KV cache")
    b, qm, hkv, d = part.num_reqs, part.max_query_len, layer.num_kv_heads, layer.head_dim
    kh = k.view(-1, hkv, d).index_select(0, part.q_pad_index).view(b, qm, hkv, d).transpose(1, 2)
    vh = v.view(-1, hkv, d).index_select(0, part.q_pad_index).view(b, qm, hkv, d).transpose(1, 2)
    return kh, vh


def _cached_kv(layer: "Attention", part: PrefillPart, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The part's keys and values gathered from the cache -> [B, Hkv, kv_len, D] each (strided views)."""
    kv = _gather_blocks(cache, part.block_index)  # [2, Hkv, B * blocks_per_req, block_size, D]
    kv = kv.view(2, layer.num_kv_heads, part.num_reqs, part.kv_len, layer.head_dim)
    return kv[0].transpose(0, 1), kv[1].transpose(0, 1)


def _prefill_padded(
    layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: PrefillPart, cache: torch.Tensor | None
) -> torch.Tensor:
    """Padded batch of prompts/chunks: q [Tp, H * D] over their cached or own keys -> [Tp, H * D]."""
    b, qm, d = part.num_reqs, part.max_query_len, layer.head_dim
    # with nothing cached the keys are this step's own: pad them like the queries, skip the cache
    own = cache is None or not part.has_context
    kh, vh = _own_kv(layer, k, v, part) if own else _cached_kv(layer, part, cache)
    qh = q.index_select(0, part.q_pad_index).view(b, qm, layer.num_heads, d).transpose(1, 2)  # [B, H, Qm, D]
    gqa = layer.num_kv_heads != layer.num_heads
    mask = part.attn_mask(q.dtype, kh.shape[2])
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(b * qm, layer.num_heads * d)  # [B * Qm, H * D]
    return out.index_select(0, part.out_index)


def _prefill(
    layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: PrefillPart, cache: torch.Tensor | None
) -> torch.Tensor:
    """Attention of the prefill part's tokens."""
    if part.causal_single:
        return _causal_single(layer, q, k, v)
    return _prefill_padded(layer, q, k, v, part, cache)


class TorchSDPABackend(AttentionBackend):
    """Reference paged attention on any device torch runs on; fast enough on CPU."""

    name = "torch_sdpa"

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """[2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]."""
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        """Split the batch into its decode and prefill parts and precompute their indexes and masks."""
        q_lens = list(common.query_lens_list) or (common.query_start_loc[1:] - common.query_start_loc[:-1]).tolist()
        seq_lens = list(common.seq_lens_list) or common.seq_lens.tolist()
        starts = [0, *itertools.accumulate(q_lens)]
        is_decode = [q == 1 and s > 1 for q, s in zip(q_lens, seq_lens)]
        decode_reqs = [r for r, flag in enumerate(is_decode) if flag]
        prefill_reqs = [r for r, flag in enumerate(is_decode) if not flag]
        decode = _build_decode(common, decode_reqs, starts, seq_lens) if decode_reqs else None
        prefill = _build_prefill(common, prefill_reqs, starts, q_lens, seq_lens) if prefill_reqs else None
        return TorchSDPAMetadata(common.slot_mapping, common.num_tokens, decode, prefill)

    @classmethod
    def forward(
        cls, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TorchSDPAMetadata
    ) -> torch.Tensor:
        """Write k, v [T, Hkv * D] into the layer's cache, attend q [T, H * D] -> [T, H * D]."""
        cache = layer.kv_cache
        if cache is not None:  # all of the step's k/v first: requests may read blocks others write now
            _write_kv(cache, k, v, metadata.slot_mapping)
        decode, prefill = metadata.decode, metadata.prefill
        if prefill is None:  # pure decode: the decode part is the whole step, in order
            return _decode(layer, q, k, v, decode, _require(cache))
        if decode is None:
            layer.backend_state = None  # a mirror follows consecutive decode passes only
            return _prefill(layer, q, k, v, prefill, cache)
        out = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim)
        take = decode.tokens.take
        decode.tokens.put(out, _decode(layer, take(q), take(k), take(v), decode, _require(cache)))
        take = prefill.tokens.take
        prefill.tokens.put(out, _prefill(layer, take(q), take(k), take(v), prefill, cache))
        return out


def _require(cache: torch.Tensor | None) -> torch.Tensor:
    """The cache; decode steps cannot run without one."""
    if cache is None:
        raise RuntimeError("a decode step needs a KV cache: call bind_kv_cache(model, caches, backend) first")
    return cache
