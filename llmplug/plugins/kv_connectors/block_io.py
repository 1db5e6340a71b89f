"""Copying whole KV blocks out of the paged cache tensors and back, as one flat byte row per block.

A block's row is every layer's slice of that block, flattened and concatenated in layer order, as raw bytes
(the cache's dtype): the same bytes whatever device the cache is on, so a row can go to memory or a file.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from llmplug.plugins.kv_connectors.base import KVLayerCache

__all__ = ["read_blocks", "row_bytes", "write_blocks"]


def row_bytes(caches: Sequence[KVLayerCache]) -> int:
    """Bytes of one block's row."""
    return sum(_block_numel(c) * c.tensor.element_size() for c in caches)


def _block_numel(cache: KVLayerCache) -> int:
    shape = cache.tensor.shape
    return math.prod(shape) // shape[cache.block_dim]


def read_blocks(caches: Sequence[KVLayerCache], block_ids: Sequence[int]) -> list[torch.Tensor]:
    """The rows of `block_ids`: one contiguous uint8 CPU tensor each, owning its memory."""
    if not block_ids:
        return []
    ids = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].tensor.device)
    # each layer: [n, elements of one block], viewed as bytes so layers of any dtype concatenate
    parts = [
        c.tensor.index_select(c.block_dim, ids).movedim(c.block_dim, 0).reshape(len(block_ids), -1)
        .view(torch.uint8) for c in caches
    ]
    rows = torch.cat(parts, dim=1).cpu()  # [n, row_bytes]
    return [row.clone() for row in rows] if len(block_ids) > 1 else [rows[0]]


def write_blocks(caches: Sequence[KVLayerCache], block_ids: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
    """Write each row into its block of every layer."""
    if not block_ids:
        return
    device = caches[0].tensor.device
    ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
    data = torch.stack(list(rows)).to(device)  # [n, row_bytes] uint8
    offset = 0
    for c in caches:
        block_shape = list(c.tensor.shape)
        del block_shape[c.block_dim]
        nbytes = _block_numel(c) * c.tensor.element_size()
        part = data[:, offset : offset + nbytes].contiguous().view(c.tensor.dtype).reshape(len(block_ids), *block_shape)
        c.tensor.index_copy_(c.block_dim, ids, part.movedim(0, c.block_dim))
        offset += nbytes
