"""The decode mirror: one layer's keys and values of the decoding requests, kept gathered across steps.

Decode attention wants each (KV head, request) context as one contiguous [kv_len, head_dim] matrix,
while the paged cache scatters it over blocks. Gathering the blocks copies the whole context of the
batch in every layer and step, and on CPU that copy costs more than the attention arithmetic. A
mirror keeps the previous step's gathered copy: when the same requests decode again, each one token
further, in the same blocks and within the same padded length, the step only appends each request's
new key and value to it. Otherwise (a request joined or left, the longest request entered a new
block, the previous forward pass had no decodes) the layer gathers the mirror again from the paged
cache, which stays the source of truth: the mirror is a copy of cache contents, never written ahead
of the cache.

A sliding-window layer whose decode batch holds a request longer than its window W mirrors only the
window, as a ring of W keys per request: the key at position p sits in slot p % W, so the slots
always hold exactly the last W keys, and each step's new key overwrites the one that left the window.
A ring never outgrows itself, so it is gathered again only when the batch changes.

Why appending is safe: a request's keys before its newest token never change while it runs, and a
block holding them is owned by that request or is a full block shared through prefix caching (same
tokens, same keys). Two consecutive passes that see the same request at seq_len s and s + 1 over the
same blocks therefore read the same keys for the first s - 1 positions, and the mirror holds exactly
those.

Memory: a mirror is as large as the gathered context of the decode batch ([2, Hkv, B, kv_len, D] per
layer); a layer keeps one only while it needs at most `MIRROR_CACHE_SHARE` of its cache's memory,
and otherwise gathers into a per-step scratch buffer shared by all layers, as without a mirror.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["MIRROR_CACHE_SHARE", "DecodeMirror", "DecodeRows", "mirror_fits"]

MIRROR_CACHE_SHARE = 1 / 8  # most of a layer's KV-cache memory its decode mirror may take in addition


@dataclass(slots=True, eq=False)
class DecodeRows:
    """The decode requests of one step, in batch order, as a mirror records them."""

    block_tables: torch.Tensor  # [B, blocks_per_req] int64, cut to the blocks of the longest request
    seq_lens: tuple[int, ...]  # keys of each request after this step (its newest token included)
    block_size: int
    _last_prev: "DecodeRows | None" = field(default=None, repr=False)
    _last_answer: bool = field(default=False, repr=False)

    def extends(self, prev: "DecodeRows") -> bool:
        """Whether these rows are `prev`'s requests one token further, their earlier keys in the same blocks.

        Asked by every layer with the rows its mirror holds (normally the same object): answered once.
        """
        if prev is not self._last_prev:
            self._last_prev, self._last_answer = prev, self._extends(prev)
        return self._last_answer

    def _extends(self, prev: "DecodeRows") -> bool:
        if len(prev.seq_lens) != len(self.seq_lens) or prev.block_size != self.block_size:
            return False  # other requests
        if any(s != p + 1 for s, p in zip(self.seq_lens, prev.seq_lens)):
            return False
        # only the blocks holding the mirrored keys (positions < s - 1) must match: the newest key may
        # sit in a block allocated this step, which `prev` shows as padding or not at all
        width = min(self.block_tables.shape[1], prev.block_tables.shape[1])
        tables, prev_tables = self.block_tables[:, :width], prev.block_tables[:, :width]
        first_position = torch.arange(width, device=tables.device) * self.block_size  # [width]
        mirrored = torch.tensor(self.seq_lens, device=tables.device) - 1  # [B] keys kept in the mirror
        must_match = first_position[None, :] < mirrored[:, None]  # [B, width]
        return not bool(((tables != prev_tables) & must_match).any())


@dataclass(slots=True, eq=False)
class DecodeMirror:
    """One layer's gathered K/V of the decode batch, and the rows it holds (the pass that last wrote it)."""

    kv: torch.Tensor  # [2, Hkv, B, kv_len, D]: K and V of each (KV head, request), padded to kv_len ([1, ...]: keys
    # holding the values, see TorchSDPABackend)
    rows: DecodeRows
    ring: int | None  # the window of a sliding-window layer's ring layout; None: keys from position 0
    # batch-invariant mode: keys_t is a contiguous copy of the keys, kept up to date with `kv`, because MKL's
    # row-invariant matmul wants contiguous [D, L] keys (fixed_order.py); copying them every step costs more
    contiguous_keys: bool = False
    # views made once, as every decode step reads the mirror through them
    key_rows: torch.Tensor = field(init=False)  # [2, Hkv, B * kv_len, D]: where appended keys/values go
    keys_t: torch.Tensor = field(init=False)  # [Hkv * B, D, kv_len]: keys transposed for q @ k^T
    values: torch.Tensor = field(init=False)  # [Hkv * B, kv_len, D] (the last plane)

    def __post_init__(self) -> None:
        planes, num_kv_heads, num_reqs, kv_len, head_dim = self.kv.shape
        self.key_rows = self.kv.view(planes, num_kv_heads, num_reqs * kv_len, head_dim)
        batched = self.kv.view(planes, num_kv_heads * num_reqs, kv_len, head_dim)
        keys_t = batched[0].transpose(1, 2)
        self.keys_t = torch.empty_like(keys_t, memory_format=torch.contiguous_format) if self.contiguous_keys else keys_t
        self.values = batched[-1]

    def copy_keys_t(self) -> None:
        """After `kv` was gathered anew: refresh the contiguous copy of its keys (a no-op without one)."""
        if self.contiguous_keys:
            num_kv_heads, num_reqs, kv_len, head_dim = self.kv.shape[1:]
            self.keys_t.copy_(self.kv[0].view(num_kv_heads * num_reqs, kv_len, head_dim).transpose(1, 2))

    def append_keys_t(self, k: torch.Tensor, index: torch.Tensor) -> None:
        """Put each request's newest key k [B, Hkv * D] into the contiguous copy at `index` [Hkv * B * D] (its
        elements in keys_t flattened: `DecodeKeys.transposed_append_index`)."""
        num_kv_heads, num_reqs, _, head_dim = self.kv.shape[1:]
        per_head = k.view(num_reqs, num_kv_heads, head_dim).transpose(0, 1).reshape(-1)  # [Hkv * B * D]
        self.keys_t.put_(index, per_head)


def mirror_fits(num_reqs: int, kv_len: int, cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a mirror of num_reqs x kv_len keys in `dtype` stays within MIRROR_CACHE_SHARE of `cache`'s bytes.

    cache: [2, Hkv, num_blocks, block_size, D]; a mirror holds the same elements per key.
    """
    cache_keys = cache.shape[2] * cache.shape[3]
    ratio = dtype.itemsize / cache.element_size()
    return num_reqs * kv_len * ratio <= cache_keys * MIRROR_CACHE_SHARE
