"""TorchSDPABackend: paged attention in plain PyTorch, a few batched ops per layer and step.

Cache layout: [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]. One `index_select` of
whole blocks gathers K and V of the whole batch, and leaves each (request, KV head) matrix
[seq, head_dim] contiguous, which is what batched matmuls want. A layer whose values are inside its
keys (`values_in_keys`, multi-head latent attention) has one plane, [1, 1, num_blocks, block_size,
head_dim]: every path below reads its values as the first v_head_dim dims of the keys' plane.

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

Optional features (see `Attention`): a sliding-window or chunked layer reads its keys through a
windowed layout (key_layout.py; built once per step, window and chunk) that gathers only what the
window or chunk reaches, and its mask; ALiBi adds its bias to the mask (decode: the baddbmm addend;
prefill: SDPA's float mask). Soft-capping and sinks change the softmax itself, so such layers compute their scores
explicitly (decode: bmm, cap, mask, softmax; prefill: the same in chunks of queries). A layer using
none of them runs exactly the paths above.

Bidirectional spans (a model's `bidirectional_spans`: Gemma 3's images) recompute their queries' rows after the
causal pass (spans.py); a step without spans runs exactly the paths above.

Bidirectional layers (encoders, `causal=False`) need each request's whole prompt in the step: one
SDPA call over the prefill part padded as above, with a key-padding mask (and |i - j| < W for a
window) instead of the causal one; a single request without a window is plain SDPA, no mask.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from llmplug.layers.attention.backend import ATTENTION_FEATURES, AttentionBackend
from llmplug.layers.attention.decode_mirror import DecodeMirror, DecodeRows, mirror_fits
from llmplug.layers.attention.features import softcap_, softmax_with_sinks
from llmplug.layers.attention.fixed_order import key_tile, round_up, scores_fp32, softmax_weighted_sum
from llmplug.layers.attention.key_layout import DecodeKeys, PrefillKeys, additive, decode_keys, prefill_keys
from llmplug.layers.attention.kv_store import converted_kv, scatter_kv, write_kv
from llmplug.layers.attention.spans import attend_spans
from llmplug.layers.forward_context import CommonAttentionMetadata
from llmplug.layers.kernels.native import ops, use_native

if TYPE_CHECKING:
    from llmplug.layers.attention.layer import Attention

__all__ = [
    "DecodePart",
    "PrefillPart",
    "TokenSelection",
    "TorchSDPABackend",
    "TorchSDPAMetadata",
    "native_attention",
    "native_capable",
]


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


def _limits(seq_lens: list[int], window: int | None, chunk: int | None) -> tuple[int | None, int | None]:
    """(window, chunk), each None when it excludes no key of these requests: they then share the full layout."""
    longest = max(seq_lens)
    return (None if window is not None and longest <= window else window), (
        None if chunk is not None and longest <= chunk else chunk
    )


@dataclass(slots=True)
class DecodePart:
    """Requests with one new token attending to their cached context."""

    tokens: TokenSelection
    num_reqs: int
    tables: torch.Tensor  # [B, blocks_per_req] the blocks covering the longest request
    seq_lens: list[int]
    rows: DecodeRows  # what a layer's decode mirror records of this step
    tile: int | None = None  # batch-invariant mode: keys per tile of the fixed-order path; None: the default paths
    _keys: dict[tuple[int | None, int | None], DecodeKeys] = field(default_factory=dict)
    _buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(default_factory=dict)

    def keys(self, window: int | None, chunk: int | None = None) -> DecodeKeys:
        """The layout of the keys a layer with this sliding window and chunk attends (built once per step;
        batch-invariant mode: no ring, every key from position 0)."""
        window, chunk = _limits(self.seq_lens, window, chunk)
        if (window, chunk) not in self._keys:
            self._keys[window, chunk] = decode_keys(
                self.tables, self.seq_lens, self.rows.block_size, window, chunk, ring=self.tile is None
            )
        return self._keys[window, chunk]

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
    q_lens: list[int]
    seq_lens: list[int]
    block_size: int
    tables: torch.Tensor | None  # [B, blocks_per_req] covering the longest request; None: nothing cached
    device: torch.device
    tile: int | None = None  # batch-invariant mode: keys per tile (keys always from the cache); None: default paths
    q_pad_index: torch.Tensor | None = None  # [B * max_query_len] part-local token of each padded query row
    out_index: torch.Tensor | None = None  # [num_part_tokens] padded row of each part-local token
    _keys: dict[tuple[int | None, int | None], PrefillKeys] = field(default_factory=dict)
    _bidirectional_masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def keys(self, window: int | None, chunk: int | None = None) -> PrefillKeys:
        """The layout of the keys a layer with this sliding window and chunk attends (built once per step)."""
        window, chunk = _limits(self.seq_lens, window, chunk)
        if (window, chunk) not in self._keys:
            self._keys[window, chunk] = prefill_keys(
                self.tables, self.q_lens, self.seq_lens, self.block_size, window, self.device, chunk, self.tile
            )
        return self._keys[window, chunk]

    def bidirectional_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask of bidirectional layers, built once per step and window: query i of a request sees its
        keys j < q_len (and |i - j| < window) -> [B, 1, 1 or Qm, Qm]."""
        if window is not None and self.max_query_len <= window:
            window = None  # the window reaches every key
        if (window, dtype) not in self._bidirectional_masks:
            j = torch.arange(self.max_query_len, device=self.device)
            keep = (j[None, :] < torch.tensor(self.q_lens, device=self.device)[:, None])[:, None, None, :]
            if window is not None:
                keep = keep & ((j[:, None] - j[None, :]).abs() < window)[None, None]
            self._bidirectional_masks[(window, dtype)] = additive(keep, dtype)
        return self._bidirectional_masks[(window, dtype)]


@dataclass(slots=True)
class TorchSDPAMetadata:
    """One step's metadata for TorchSDPABackend: the step as the runner flattened it (what llmplug's CPU kernels
    read), and its decode and prefill parts for the torch paths, split when a layer first asks."""

    common: CommonAttentionMetadata
    _parts: tuple[DecodePart | None, PrefillPart | None] | None = None

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[T] cache slot of each token."""
        return self.common.slot_mapping

    @property
    def decode(self) -> DecodePart | None:
        """Requests with one new token attending to their cached context (None: no such request)."""
        return self._split()[0]

    @property
    def prefill(self) -> PrefillPart | None:
        """Every other request (None: no such request)."""
        return self._split()[1]

    def _split(self) -> tuple[DecodePart | None, PrefillPart | None]:
        if self._parts is None:
            self._parts = _split_parts(self.common)
        return self._parts


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


def _request_blocks(
    common: CommonAttentionMetadata, reqs: list[int], max_seq_len: int, tile: int | None = None
) -> torch.Tensor:
    """Block tables [len(reqs), blocks_per_req] covering max_seq_len keys of each request (with `tile`: whole
    tiles of keys, the columns past the table's own pointing at block 0, which the masks hide)."""
    num_blocks = -(-max_seq_len // common.block_size)
    if common.block_tables.shape[1] < num_blocks:
        raise ValueError(
            f"block_tables has {common.block_tables.shape[1]} columns but a request holds {max_seq_len} tokens "
            f"({num_blocks} blocks of {common.block_size}): the model runner must pass every request's blocks"
        )
    tables = common.block_tables
    if len(reqs) != common.num_reqs:
        tables = tables.index_select(0, torch.tensor(reqs, device=tables.device))
    if tile is not None:
        num_blocks = round_up(num_blocks * common.block_size, tile) // common.block_size
        tables = F.pad(tables, (0, max(0, num_blocks - tables.shape[1])))
    return tables[:, :num_blocks]


def _build_decode(
    common: CommonAttentionMetadata, reqs: list[int], starts: list[int], seq_lens: list[int], tile: int | None
) -> DecodePart:
    """The decode requests' tokens and blocks; their key layouts are built when a layer first asks."""
    lens = [seq_lens[r] for r in reqs]
    tables = _request_blocks(common, reqs, max(lens), tile)
    rows = DecodeRows(tables, tuple(lens), common.block_size)
    tokens = _select_tokens(reqs, starts, common.slot_mapping.device)
    return DecodePart(tokens, len(reqs), tables, lens, rows, tile)


def _build_prefill(
    common: CommonAttentionMetadata,
    reqs: list[int],
    starts: list[int],
    q_lens: list[int],
    seq_lens: list[int],
    tile: int | None,
) -> PrefillPart:
    """The prefill requests' tokens, blocks and padding indexes; key layouts come when a layer asks.

    Batch-invariant mode (`tile`) reads every request's keys from the cache, in the same layout whether
    they were computed in this step or an earlier one."""
    device = common.slot_mapping.device
    part_q, part_seq = [q_lens[r] for r in reqs], [seq_lens[r] for r in reqs]
    has_context = any(s > q for q, s in zip(part_q, part_seq))
    from_cache = has_context or tile is not None
    tables = _request_blocks(common, reqs, max(part_seq), tile) if from_cache else None
    causal_single = len(reqs) == 1 and not from_cache
    part = PrefillPart(
        _select_tokens(reqs, starts, device), len(reqs), max(part_q), has_context,
        causal_single, part_q, part_seq, common.block_size, tables, device, tile=tile,
    )
    if not part.causal_single:  # one request needs no padding: its rows are the padded rows
        part.q_pad_index, part.out_index = _padding_indexes(torch.tensor(part_q, device=device), part.max_query_len)
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


def _decode_kv(
    layer: "Attention", k: torch.Tensor, v: torch.Tensor, part: DecodePart, keys: DecodeKeys, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode requests' keys, transposed, and values, this step's included, laid out as `keys`.

    -> keys [Hkv * B, D, kv_len], values [Hkv * B, kv_len, D]; batch index = kv_head * B + request.
    From the layer's mirror when it holds the previous step of the same requests in the same layout
    (append the new k, v [B, Hkv * D]); else gathered from the cache (already holding this step's
    k, v) into the mirror, or into a scratch buffer when a mirror would take too much memory.
    In batch-invariant mode, and from a half-precision cache on the CPU, the keys and values come in float32
    (the mirror holds them so, converted once): see `_decodes_in_float32`.
    """
    shape = (cache.shape[0], layer.num_kv_heads, part.num_reqs, keys.kv_len, layer.head_dim)
    dtype = torch.float32 if _decodes_in_float32(cache, part) else cache.dtype
    if not mirror_fits(part.num_reqs, keys.kv_len, cache, dtype):
        layer.backend_state = None
        gathered = part.gather_buffer(shape, cache.dtype, cache.device)
        keys.gather(cache, gathered)
        batched = gathered.view(shape[0], shape[1] * shape[2], shape[3], shape[4]).to(dtype)
        return batched[0].transpose(1, 2), batched[-1]
    mirror = layer.backend_state
    same_layout = (
        isinstance(mirror, DecodeMirror) and mirror.kv.shape == shape and mirror.kv.dtype == dtype
        and mirror.ring == keys.ring
    )
    if same_layout and part.rows.extends(mirror.rows):
        k, v = converted_kv(k, v, dtype)
        scatter_kv(mirror.key_rows, k, v, keys.append_index)
        if mirror.contiguous_keys:
            mirror.append_keys_t(k, keys.transposed_append_index(layer.num_kv_heads, layer.head_dim))
    else:
        if not same_layout:  # else regather in place
            empty = torch.empty(shape, dtype=dtype, device=cache.device)
            # contiguous [D, L] keys: what the fixed-order path needs, and float32 bmm on the CPU is faster with
            mirror = DecodeMirror(empty, part.rows, keys.ring, contiguous_keys=_decodes_in_float32(cache, part))
            layer.backend_state = mirror
        if dtype == cache.dtype:
            keys.gather(cache, mirror.kv)
        else:  # index_select cannot convert: gather in the cache's dtype, then convert
            gathered = part.gather_buffer(shape, cache.dtype, cache.device)
            keys.gather(cache, gathered)
            mirror.kv.copy_(gathered)
        mirror.copy_keys_t()
    mirror.rows = part.rows
    return mirror.keys_t, mirror.values


def _decodes_in_float32(cache: torch.Tensor, part: DecodePart) -> bool:
    """Whether decode attention computes in float32 (else in the cache's dtype), from contiguous [D, L] keys:
    in batch-invariant mode (fixed_order.py) and on the CPU, where a batched matmul of a few query rows takes
    ~5x longer in bf16 or fp16 than in float32 (SmolLM2's [3, 64] x [64, 80] heads: ~45 us against ~7 us)."""
    return part.tile is not None or cache.device.type == "cpu"


def _plain(layer: "Attention") -> bool:
    """Whether the layer's scores are plain scaled dot products plus a mask (no ALiBi, cap or sinks)."""
    return layer.alibi_slopes is None and layer.logit_softcap is None and layer.sinks is None


def _decode(
    layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: DecodePart, cache: torch.Tensor
) -> torch.Tensor:
    """q, k, v [B, heads * D] of one token per request over each request's cached keys -> [B, H * D]."""
    b, hkv, g, d = part.num_reqs, layer.num_kv_heads, layer.num_queries_per_kv, layer.head_dim
    keys = part.keys(layer.sliding_window, layer.attention_chunk)
    keys_t, values = _decode_kv(layer, k, v, part, keys, cache)  # [Hkv * B, D, kv_len], [Hkv * B, kv_len, D]
    values = values[..., : layer.v_head_dim]  # values inside keys: their leading dims
    qh = q.view(b, hkv, g, d).transpose(0, 1).reshape(hkv * b, g, d).to(keys_t.dtype)  # [Hkv * B, G, D]
    if part.tile is not None:
        out = _decode_fixed_order(layer, qh, keys_t, values, keys, part.tile)  # [Hkv * B, G, Dv]
    elif _plain(layer):
        mask = keys.score_mask(hkv, g, qh.dtype)
        scores = torch.baddbmm(mask, qh, keys_t, alpha=layer.scale)  # [Hkv * B, G, kv_len]
        out = torch.bmm(torch.softmax(scores, dim=-1), values)
    else:
        out = torch.bmm(_decode_probs(layer, qh, keys_t, keys), values)
    dv = layer.v_head_dim
    out = out.to(q.dtype).view(hkv, b, g, dv)
    return out.transpose(0, 1).reshape(b, layer.num_heads * dv)  # heads in order kv * G + g


def _decode_scores(layer: "Attention", scores: torch.Tensor, keys: DecodeKeys) -> torch.Tensor | None:
    """Scale, cap, mask and bias raw decode scores [Hkv * B, G, kv_len] in place; -> the sinks [Hkv * B, G, 1]
    (float32) of a layer with sinks, else None."""
    hkv, g, b = layer.num_kv_heads, layer.num_queries_per_kv, keys.num_reqs
    scores.mul_(layer.scale)
    if layer.logit_softcap is not None:
        softcap_(scores, layer.logit_softcap)
    if not keys.all_seen:
        scores += keys.score_mask(hkv, g, scores.dtype)
    if layer.alibi_slopes is not None:
        scores += keys.alibi_bias(layer.alibi_slopes, hkv, g)
    if layer.sinks is None:
        return None
    return layer.sinks.view(hkv, 1, g, 1).expand(hkv, b, g, 1).reshape(hkv * b, g, 1)  # head kv * G + g


def _decode_probs(layer: "Attention", qh: torch.Tensor, keys_t: torch.Tensor, keys: DecodeKeys) -> torch.Tensor:
    """Attention weights [Hkv * B, G, kv_len] of a layer with ALiBi, soft-capping or sinks."""
    scores = torch.bmm(qh, keys_t)  # [Hkv * B, G, kv_len]
    sinks = _decode_scores(layer, scores, keys)
    return softmax_with_sinks(scores, sinks)


def _decode_fixed_order(
    layer: "Attention", qh: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, keys: DecodeKeys, tile: int
) -> torch.Tensor:
    """Batch-invariant decode (fixed_order.py): qh [Hkv * B, G, D] over keys_t [Hkv * B, D, kv_len] and values
    [Hkv * B, kv_len, Dv] (float32) -> [Hkv * B, G, Dv] float32."""
    scores = scores_fp32(qh, keys_t)  # [Hkv * B, G, kv_len]
    sinks = _decode_scores(layer, scores, keys)
    return softmax_weighted_sum(scores, values, tile, sinks)


def _rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """x's rows at `index` (None: all of them, in order)."""
    return x if index is None else x.index_select(0, index)


def _causal_single(layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One prompt with nothing cached: causal attention over its own q, k, v [T, heads * D] -> [T, H * D]."""
    t, d, dv = q.shape[0], layer.head_dim, layer.v_head_dim
    qh = q.view(1, t, layer.num_heads, d).transpose(1, 2)  # [1, H, T, D]
    kh = k.view(1, t, layer.num_kv_heads, d).transpose(1, 2)  # [1, Hkv, T, D]
    vh = v.view(1, t, layer.num_kv_heads, dv).transpose(1, 2)  # [1, Hkv, T, Dv]
    gqa = layer.num_kv_heads != layer.num_heads
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=layer.scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(t, layer.num_heads * dv)


def _own_kv(
    layer: "Attention", k: torch.Tensor, v: torch.Tensor, part: PrefillPart
) -> tuple[torch.Tensor, torch.Tensor]:
    """The part's own k, v padded like the queries -> [B, Hkv, Qm, D (Dv for v)] (nothing cached)."""
    b, qm, hkv, d, dv = part.num_reqs, part.max_query_len, layer.num_kv_heads, layer.head_dim, layer.v_head_dim
    kh = _rows(k.view(-1, hkv, d), part.q_pad_index).view(b, qm, hkv, d).transpose(1, 2)
    vh = _rows(v.view(-1, hkv, dv), part.q_pad_index).view(b, qm, hkv, dv).transpose(1, 2)
    return kh, vh


def _cached_kv(
    layer: "Attention", part: PrefillPart, keys: PrefillKeys, cache: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The part's keys and values gathered from the cache -> [B, Hkv, kv_len, D (Dv for v)] (strided views)."""
    if cache is None:
        raise RuntimeError("a request with cached context was scheduled but the Attention layer has no KV cache")
    kv = cache.index_select(2, keys.block_index)  # [2 (or 1), Hkv, B * blocks_per_req, block_size, D]
    kv = kv.view(cache.shape[0], layer.num_kv_heads, part.num_reqs, keys.kv_len, layer.head_dim)
    return kv[0].transpose(0, 1), kv[-1][..., : layer.v_head_dim].transpose(0, 1)


def _prefill_padded(
    layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: PrefillPart, cache: torch.Tensor | None
) -> torch.Tensor:
    """Padded batch of prompts/chunks: q [Tp, H * D] over their cached or own keys -> [Tp, H * D]."""
    b, qm, d = part.num_reqs, part.max_query_len, layer.head_dim
    keys = part.keys(layer.sliding_window, layer.attention_chunk)
    # with nothing cached the keys are this step's own: pad them like the queries, skip the cache
    kh, vh = _own_kv(layer, k, v, part) if keys.block_index is None else _cached_kv(layer, part, keys, cache)
    qh = _rows(q, part.q_pad_index).view(b, qm, layer.num_heads, d).transpose(1, 2)  # [B, H, Qm, D]
    if part.tile is not None:
        out = _explicit_attention(layer, qh, kh, vh, keys, part.tile)
    elif layer.logit_softcap is None and layer.sinks is None:
        mask = keys.attn_mask(q.dtype)  # [B, 1, Qm, kv_len]
        if layer.alibi_slopes is not None:
            mask = mask + _alibi(layer, keys).to(q.dtype)  # [B, H, Qm, kv_len]
        gqa = layer.num_kv_heads != layer.num_heads
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
    else:
        out = _explicit_attention(layer, qh, kh, vh, keys)
    out = out.transpose(1, 2).reshape(b * qm, layer.num_heads * layer.v_head_dim)  # [B * Qm, H * Dv]
    return _rows(out, part.out_index)


def _alibi(layer: "Attention", keys: PrefillKeys, rows: slice = slice(None)) -> torch.Tensor:
    """ALiBi bias [B, H, rows, kv_len] (float32) of the query rows `rows`."""
    return layer.alibi_slopes.view(1, -1, 1, 1) * keys.alibi_offsets(rows)


# scores (elements) one chunk of queries of the explicit prefill path may hold: bounds its memory
EXPLICIT_SCORES_PER_CHUNK = 1 << 26


def _explicit_attention(
    layer: "Attention", qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, keys: PrefillKeys, tile: int | None = None
) -> torch.Tensor:
    """Scores, cap, mask (+ ALiBi), softmax (with sinks), weighted sum -> [B, H, Qm, D], in query chunks.

    qh [B, H, Qm, D]; kh [B, Hkv, kv_len, D], vh [B, Hkv, kv_len, Dv]. The G query heads of a KV head
    attend as one [G * rows, kv_len] matrix, so keys are not repeated per query head. With `tile`
    (batch-invariant mode) the scores and the sum are float32 and reduce in fixed order (fixed_order.py).
    """
    b, h, qm, d = qh.shape
    hkv, g, dv, kv_len = layer.num_kv_heads, layer.num_queries_per_kv, vh.shape[-1], keys.kv_len
    sinks = None if layer.sinks is None else layer.sinks.view(1, h, 1, 1)
    if tile is not None:  # [B * Hkv, kv_len, D (Dv)] float32, contiguous
        kh = kh.to(torch.float32).reshape(b * hkv, kv_len, d)
        vh = vh.to(torch.float32).reshape(b * hkv, kv_len, dv)
    out = qh.new_empty(b, h, qm, dv)
    chunk = max(1, EXPLICIT_SCORES_PER_CHUNK // (b * h * kv_len))
    for start in range(0, qm, chunk):
        rows = slice(start, min(start + chunk, qm))
        n = rows.stop - rows.start
        qg = qh[:, :, rows].reshape(b, hkv, g * n, d)  # heads kv * G + g -> [B, Hkv, G * n, D]
        if tile is None:
            scores = torch.matmul(qg, kh.transpose(2, 3)).view(b, h, n, kv_len)
        else:
            scores = scores_fp32(qg.reshape(b * hkv, g * n, d), kh.transpose(1, 2)).reshape(b, h, n, kv_len)
        scores.mul_(layer.scale)
        if layer.logit_softcap is not None:
            softcap_(scores, layer.logit_softcap)
        scores += keys.attn_mask(scores.dtype)[:, :, rows]
        if layer.alibi_slopes is not None:
            scores += _alibi(layer, keys, rows)
        if tile is None:
            probs = softmax_with_sinks(scores, sinks).view(b, hkv, g * n, kv_len)
            out[:, :, rows] = torch.matmul(probs, vh).view(b, h, n, dv)
            continue
        row_sinks = None if sinks is None else sinks.expand(b, h, n, 1).reshape(b * hkv, g * n, 1)
        weighted = softmax_weighted_sum(scores.view(b * hkv, g * n, kv_len), vh, tile, row_sinks)
        out[:, :, rows] = weighted.view(b, h, n, dv)
    return out


def _prefill(
    layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, part: PrefillPart, cache: torch.Tensor | None
) -> torch.Tensor:
    """Attention of the prefill part's tokens."""
    reach = min(layer.sliding_window or part.max_query_len, layer.attention_chunk or part.max_query_len)
    if part.causal_single and _plain(layer) and part.max_query_len <= reach:  # never in batch-invariant mode
        return _causal_single(layer, q, k, v)
    return _prefill_padded(layer, q, k, v, part, cache)


def _bidirectional(
    layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TorchSDPAMetadata
) -> torch.Tensor:
    """Each request's queries over all of its own keys (an encoder layer): q [T, H * D] -> [T, H * D]."""
    part = metadata.prefill
    if metadata.decode is not None or part.has_context:
        raise RuntimeError(
            f"bidirectional Attention {layer.layer_name!r} got a request with tokens from an earlier step: "
            "an encoder sees each prompt whole, in one step (pooling prompts are never chunked)"
        )
    b, qm, d = part.num_reqs, part.max_query_len, layer.head_dim
    qh = _rows(q, part.q_pad_index).view(b, qm, layer.num_heads, d).transpose(1, 2)  # [B, H, Qm, D]
    kh, vh = _own_kv(layer, k, v, part)  # [B, Hkv, Qm, D]
    window = layer.sliding_window
    mask = None
    if not part.causal_single or (window is not None and qm > window):
        mask = part.bidirectional_mask(window, q.dtype)
    gqa = layer.num_kv_heads != layer.num_heads
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
    return _rows(out.transpose(1, 2).reshape(b * qm, layer.num_heads * d), part.out_index)


class TorchSDPABackend(AttentionBackend):
    """Reference paged attention on any device torch runs on; fast enough on CPU."""

    name = "torch_sdpa"
    supported_features = ATTENTION_FEATURES
    supports_batch_invariant = True
    supports_bidirectional_spans = True

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """[2 (K, V), num_kv_heads, num_blocks, block_size, head_dim]."""
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    @classmethod
    def layer_kv_cache_shape(cls, layer: "Attention", num_blocks: int, block_size: int) -> tuple[int, ...]:
        """kv_cache_shape; one plane [1, Hkv, num_blocks, block_size, D] when the values are inside the keys."""
        planes = 1 if layer.values_in_keys else 2
        return (planes, layer.num_kv_heads, num_blocks, block_size, layer.head_dim)

    @classmethod
    def computes_prompt_rows_apart(cls, layer: "Attention", dtype: torch.dtype, device: torch.device,
                                   block_size: int) -> bool:
        """The CPU kernels' AMX prompt tiles (prompt_rows_apart)."""
        return prompt_rows_apart(layer, dtype, device, block_size)

    @classmethod
    def discard_step(cls, layer: "Attention", slot_mapping: torch.Tensor) -> None:
        """Zero the failed step's slots and drop the decode mirror: decode pads keys to the batch's longest and
        the batch-invariant mode to whole tiles, reading slots no request owns (masked, but 0 * NaN is NaN)."""
        layer.backend_state = None
        cache = layer.kv_cache
        if cache is not None:
            cache.view(cache.shape[0], cache.shape[1], -1, cache.shape[-1]).index_fill_(2, slot_mapping, 0)

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TorchSDPAMetadata:
        """The step's metadata; its decode and prefill parts (and their key layouts and masks) are built when the
        first layer on the torch paths asks for them, once per step (per sliding window for the layouts)."""
        return TorchSDPAMetadata(common)

    @classmethod
    def forward(
        cls, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TorchSDPAMetadata
    ) -> torch.Tensor:
        """Write k, v [T, Hkv * D] into the layer's cache, attend q [T, H * D] -> [T, H * Dv] (Dv = D unless
        the values are inside the keys: v is None, and its rows are k's first Dv dims)."""
        if layer.values_in_keys:
            v = k[:, : layer.v_head_dim]  # one KV head: [T, Dv], a view of k
        out = cls._attend(layer, q, k, v, metadata)
        if metadata.common.bidirectional_spans and layer.causal:  # only for a model that declares them
            common = metadata.common
            attend_spans(layer, q, out, _require(layer.kv_cache), common.bidirectional_spans, common.block_tables,
                         common.block_size)
        return out

    @classmethod
    def _attend(
        cls, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TorchSDPAMetadata
    ) -> torch.Tensor:
        """Store k, v and attend causally (or bidirectionally, an encoder layer) -> [T, H * Dv]."""
        cache = layer.kv_cache
        if cache is not None and native_capable(layer) and use_native(q):
            return native_attention(layer, q, k, v, cache, metadata)
        if cache is not None:  # all of the step's k/v first: requests may read blocks others write now
            write_kv(cache, k, v, metadata.slot_mapping)
        if not layer.causal:
            return _bidirectional(layer, q, k, v, metadata)
        decode, prefill = metadata.decode, metadata.prefill
        if prefill is None:  # pure decode: the decode part is the whole step, in order
            return _decode(layer, q, k, v, decode, _require(cache))
        if decode is None:
            layer.backend_state = None  # a mirror follows consecutive decode passes only
            return _prefill(layer, q, k, v, prefill, cache)
        out = q.new_empty(q.shape[0], layer.num_heads * layer.v_head_dim)
        take = decode.tokens.take
        decode.tokens.put(out, _decode(layer, take(q), take(k), take(v), decode, _require(cache)))
        take = prefill.tokens.take
        prefill.tokens.put(out, _prefill(layer, take(q), take(k), take(v), prefill, cache))
        return out


def prompt_rows_apart(layer: "Attention", dtype: torch.dtype, device: torch.device, block_size: int) -> bool:
    """Whether llmplug's CPU attention computes this layer's prompt rows with its AMX prompt tiles (docs/kernels.md),
    and its generated rows with the float32 rows: bf16 layers the kernels serve, with the kernel's own condition."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not native_capable(layer) or not use_native(torch.empty(0)):
        return False
    return bool(ops().prompt_tile_supported(layer.head_dim, layer.v_head_dim, block_size, layer.sliding_window or 0,
                                            layer.attention_chunk or 0))


def native_capable(layer: "Attention") -> bool:
    """Whether llmplug's CPU kernels store and attend for this layer when its cache is bound and the step's tensors are
    CPU tensors (`use_native`): a causal layer with plain scores (a window or chunk allowed). Fixed per layer, so
    every step of a request takes the same path: the kernel's rows are batch invariant by construction."""
    return layer.causal and _plain(layer)


def native_attention(
    layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
    metadata: TorchSDPAMetadata,
) -> torch.Tensor:
    """Store the step's k, v, then attend every token over its request's cached keys (one kernel call with two
    planes, two with one): q [T, H * D] -> [T, H * Dv]."""
    if layer.backend_state is not None:
        layer.backend_state = None  # no decode mirror: the kernel reads the cache's blocks in place
    common, window, chunk = metadata.common, layer.sliding_window or 0, layer.attention_chunk or 0
    if cache.size(0) == 2:
        return ops().cache_and_attend(
            q, k, v, cache, common.slot_mapping, common.block_tables, common.query_start_loc, common.seq_lens,
            layer.scale, window, chunk, common.prompt_lens,
        )
    write_kv(cache, k, v, common.slot_mapping)  # values inside the keys: one plane
    return ops().paged_attention(
        q.view(q.shape[0], layer.num_heads, layer.head_dim), cache[0], cache[0][..., : layer.v_head_dim],
        common.block_tables, common.query_start_loc, common.seq_lens, layer.scale, window, chunk, common.prompt_lens,
    )


def _split_parts(common: CommonAttentionMetadata) -> tuple[DecodePart | None, PrefillPart | None]:
    """Split the batch into its decode and prefill parts."""
    q_lens = list(common.query_lens_list) or (common.query_start_loc[1:] - common.query_start_loc[:-1]).tolist()
    seq_lens = list(common.seq_lens_list) or common.seq_lens.tolist()
    starts = [0, *itertools.accumulate(q_lens)]
    is_decode = [q == 1 and s > 1 for q, s in zip(q_lens, seq_lens)]
    decode_reqs = [r for r, flag in enumerate(is_decode) if flag]
    prefill_reqs = [r for r, flag in enumerate(is_decode) if not flag]
    tile = key_tile(common.block_size) if common.batch_invariant else None
    decode = _build_decode(common, decode_reqs, starts, seq_lens, tile) if decode_reqs else None
    prefill = _build_prefill(common, prefill_reqs, starts, q_lens, seq_lens, tile) if prefill_reqs else None
    return decode, prefill


def _require(cache: torch.Tensor | None) -> torch.Tensor:
    """The cache; decode steps cannot run without one."""
    if cache is None:
        raise RuntimeError("a decode step needs a KV cache: call bind_kv_cache(model, caches, backend) first")
    return cache
