"""Which cached keys the queries of a step attend, laid out as one gathered context per request.

A layout says which cache blocks (or slots) to gather into a [B, kv_len] context, the position of
each gathered key, and so which keys each query sees. Full attention gathers every block from the
first. A sliding-window layer (query at position i sees keys i - W < j <= i) gathers only what its
window reaches: in prefill, the blocks from the one holding the earliest key any query of the
request sees; in decode, a ring of W slots per request, the key at position p in slot p % W (see
decode_mirror.py). A chunked layer (query at i sees keys floor(i / C) * C <= j <= i) gathers as a
window of C does, which reaches back to every chunk start, and masks the keys before its chunk.
Layouts depend only on the batch, the window and the chunk, so a step builds each once and every
layer with those shares it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["DecodeKeys", "PrefillKeys", "additive", "decode_keys", "prefill_keys"]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean keep-mask -> 0 / -inf additive mask (SDPA would otherwise convert it on every call)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


@dataclass(slots=True)
class DecodeKeys:
    """The keys of the decode requests (one query each, at position seq_len - 1) as [B, kv_len]."""

    gather_index: torch.Tensor  # ring is None: [B * blocks_per_req] cache blocks; else [B * kv_len] cache slots
    kv_len: int
    ring: int | None  # the window W of a ring layout (kv_len == W); None: keys from position 0
    positions: torch.Tensor  # [B or 1, kv_len] position of each gathered key
    seq_lens: torch.Tensor  # [B]
    all_seen: bool  # every gathered key is one the query sees (no key mask)
    chunk_starts: torch.Tensor | None = None  # [B, 1] first key of each query's chunk (chunked attention)
    window: int | None = None  # a sliding window applied by the mask (the full layout of batch-invariant mode)
    _masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)
    _append_index: torch.Tensor | None = None
    _transposed_append_index: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        """B, the decode requests."""
        return self.seq_lens.shape[0]

    @property
    def append_index(self) -> torch.Tensor:
        """[B] row of each request's newest key in a context viewed as [B * kv_len] (built once)."""
        if self._append_index is None:
            newest = self.seq_lens - 1
            slot = newest if self.ring is None else newest % self.ring
            self._append_index = torch.arange(self.num_reqs, device=slot.device) * self.kv_len + slot
        return self._append_index

    def transposed_append_index(self, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """[Hkv * B * D] element of each request's newest key in keys laid out [Hkv * B, D, kv_len] and flattened,
        in the order of k [B, Hkv, D] transposed to [Hkv, B, D] (built once per step and head shape)."""
        key = (num_kv_heads, head_dim)
        if key not in self._transposed_append_index:
            device = self.seq_lens.device
            slot = self.append_index - torch.arange(self.num_reqs, device=device) * self.kv_len  # [B]
            rows = torch.arange(num_kv_heads * self.num_reqs, device=device)[:, None] * head_dim  # head * B + request
            columns = (rows + torch.arange(head_dim, device=device)) * self.kv_len  # [Hkv * B, D]
            self._transposed_append_index[key] = (columns + slot.repeat(num_kv_heads)[:, None]).reshape(-1)
        return self._transposed_append_index[key]

    def seen(self) -> torch.Tensor:
        """[B, kv_len] bool: the gathered keys the query sees (the rest is padding, another chunk or outside the
        window)."""
        seen = (self.positions >= 0) & (self.positions < self.seq_lens[:, None])
        if self.window is not None:
            seen &= self.positions >= self.seq_lens[:, None] - self.window
        if self.chunk_starts is not None:
            seen &= self.positions >= self.chunk_starts
        return seen

    def score_mask(self, num_kv_heads: int, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive key mask [Hkv * B, G, kv_len] in `dtype`, laid out like the scores (built once per step)."""
        key = (num_kv_heads, group, dtype)
        if key not in self._masks:
            device = self.seq_lens.device
            if self.all_seen:  # zeros: baddbmm still needs an addend, and this costs one step-wide alloc
                mask = torch.zeros(self.num_reqs, self.kv_len, dtype=dtype, device=device)
            else:
                mask = additive(self.seen(), dtype)  # [B, kv_len]
            expanded = mask[None, :, None, :].expand(num_kv_heads, -1, group, -1)
            self._masks[key] = expanded.reshape(num_kv_heads * self.num_reqs, group, self.kv_len)
        return self._masks[key]

    def alibi_bias(self, slopes: torch.Tensor, num_kv_heads: int, group: int) -> torch.Tensor:
        """slope_h * (j - i) [Hkv * B, G, kv_len] (float32), laid out like the scores."""
        offsets = (self.positions - (self.seq_lens[:, None] - 1)).float()  # [B, kv_len], <= 0 for seen keys
        bias = slopes.view(num_kv_heads, 1, group, 1) * offsets.expand(self.num_reqs, -1)[None, :, None, :]
        return bias.reshape(num_kv_heads * self.num_reqs, group, self.kv_len)

    def gather(self, cache: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the keys and values of cache [P, Hkv, num_blocks, block_size, D] into out [P, Hkv, B, kv_len, D]
        (P = 2 planes, K and V, or 1 when the values are inside the keys)."""
        planes = cache.shape[0]
        if self.ring is None:
            torch.index_select(cache, 2, self.gather_index, out=out.view(planes, out.shape[1], -1, *cache.shape[3:]))
        else:
            slots = cache.view(planes, cache.shape[1], -1, cache.shape[-1])
            torch.index_select(slots, 2, self.gather_index, out=out.view(planes, out.shape[1], -1, out.shape[-1]))


def _reach(window: int | None, chunk: int | None) -> int | None:
    """How far back a query's keys may lie: its window, or a chunk's length (the nearer of the two)."""
    if chunk is None or window is None:
        return window if chunk is None else chunk
    return min(window, chunk)


def decode_keys(
    tables: torch.Tensor,
    seq_lens: list[int],
    block_size: int,
    window: int | None,
    chunk: int | None = None,
    ring: bool = True,
) -> DecodeKeys:
    """The decode layout of requests with `seq_lens` keys (tables [B, blocks] cover the longest).

    A ring of `window` (or `chunk`) slots when some request is longer (unless `ring` is False: then every
    block from position 0, the window and chunk applied by the mask); else every block.
    """
    device = tables.device
    lens = torch.tensor(seq_lens, device=device)
    reach = _reach(window, chunk)
    if reach is not None and max(seq_lens) <= reach:  # the window and chunk, if any, reach back to position 0
        window = chunk = reach = None
    starts = None if chunk is None else [(s - 1) // chunk * chunk for s in seq_lens]  # the newest query's chunk
    chunk_starts = None if starts is None else torch.tensor(starts, device=device)[:, None]
    if reach is None or not ring:
        kv_len = tables.shape[1] * block_size
        positions = torch.arange(kv_len, device=device)[None, :]  # [1, kv_len]
        all_seen = reach is None and all(n == kv_len for n in seq_lens)
        return DecodeKeys(tables.reshape(-1), kv_len, None, positions, lens, all_seen, chunk_starts, window)
    newest = lens[:, None] - 1  # [B, 1]
    # slot r holds the latest position p <= newest with p % reach == r (negative: not written yet)
    positions = newest - (newest - torch.arange(reach, device=device)[None, :]) % reach  # [B, W]
    stored = positions.clamp(min=0)
    slots = tables.gather(1, stored // block_size) * block_size + stored % block_size  # [B, W]
    if chunk is None:
        return DecodeKeys(slots.reshape(-1), reach, reach, positions, lens, min(seq_lens) >= reach)
    all_seen = all(s - reach >= start for s, start in zip(seq_lens, starts))
    return DecodeKeys(slots.reshape(-1), reach, reach, positions, lens, all_seen, chunk_starts)


@dataclass(slots=True)
class PrefillKeys:
    """The keys the prefill part's queries attend, per request [kv_len], and the mask of which each sees."""

    block_index: torch.Tensor | None  # [B * blocks_per_req] cache blocks to gather; None: the step's own k/v
    kv_len: int
    key_positions: torch.Tensor  # [B, kv_len]
    query_positions: torch.Tensor  # [B, Qm]; padded query rows repeat the request's last query
    mask: torch.Tensor  # [B, 1, Qm, kv_len] bool
    _float_masks: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def attn_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask, additive in `dtype` (built once per step)."""
        if dtype not in self._float_masks:
            self._float_masks[dtype] = additive(self.mask, dtype)
        return self._float_masks[dtype]

    def alibi_offsets(self, rows: slice = slice(None)) -> torch.Tensor:
        """j - i [B, 1, Qm, kv_len] (float32) of the query rows `rows`."""
        offsets = self.key_positions[:, None, :] - self.query_positions[:, rows, None]  # [B, rows, kv_len]
        return offsets.float().unsqueeze(1)


def prefill_keys(
    tables: torch.Tensor | None,
    q_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    window: int | None,
    device: torch.device,
    chunk: int | None = None,
    tile: int | None = None,
) -> PrefillKeys:
    """The prefill layout of requests computing their last q_lens of seq_lens tokens.

    tables [B, >= blocks of the longest] gathers the keys from the cache; None: the keys are the step's
    own (nothing cached), padded like the queries. A window (or chunk) skips the blocks no query reaches.
    `tile` (batch-invariant mode, a multiple of block_size): the keys start at a multiple of `tile` and
    are whole tiles.
    """
    reach = _reach(window, chunk)
    contexts = [s - q for q, s in zip(q_lens, seq_lens)]
    first_keys = [0] * len(q_lens)  # position of each request's first gathered key
    block_index = None
    align = tile or block_size
    if tables is None:
        kv_len = max(q_lens) if tile is None else -(-max(q_lens) // tile) * tile
    else:
        if reach is not None:  # the earliest key a query may see: context - reach + 1
            first_keys = [max(0, c - reach + 1) // align * align for c in contexts]
        num_blocks = max(-(-s // block_size) - f // block_size for s, f in zip(seq_lens, first_keys))
        if tile is not None:
            num_blocks = -(-num_blocks * block_size // tile) * tile // block_size
        kv_len = num_blocks * block_size
        first_block = torch.tensor([f // block_size for f in first_keys], device=device)
        columns = (first_block[:, None] + torch.arange(num_blocks, device=device)).clamp(max=tables.shape[1] - 1)
        block_index = tables.gather(1, columns).reshape(-1)  # the clamped columns are padding: masked below
    return _with_mask(block_index, kv_len, first_keys, contexts, q_lens, window, chunk, device)


def _with_mask(
    block_index: torch.Tensor | None,
    kv_len: int,
    first_keys: list[int],
    contexts: list[int],
    q_lens: list[int],
    window: int | None,
    chunk: int | None,
    device: torch.device,
) -> PrefillKeys:
    """The layout with its mask: query i (position context + i) sees keys j <= its position, within the window
    and its chunk."""
    max_query_len = max(q_lens)
    key_positions = torch.tensor(first_keys, device=device)[:, None] + torch.arange(kv_len, device=device)
    i = torch.arange(max_query_len, device=device)
    last = torch.tensor(q_lens, device=device)[:, None] - 1
    query_positions = torch.tensor(contexts, device=device)[:, None] + torch.minimum(i[None, :], last)  # [B, Qm]
    mask = key_positions[:, None, :] <= query_positions[:, :, None]  # [B, Qm, kv_len]
    if window is not None:
        mask &= key_positions[:, None, :] > query_positions[:, :, None] - window
    if chunk is not None:
        mask &= key_positions[:, None, :] >= (query_positions // chunk * chunk)[:, :, None]
    return PrefillKeys(block_index, kv_len, key_positions, query_positions, mask.unsqueeze(1))
