"""Storing a step's keys and values into a paged KV cache [2 (K, V), Hkv, num_blocks, block_size, D] (or a one-plane
cache [1, ...] whose values are inside its keys), or into a decode mirror's rows; k and v side by side in one tensor
(a fused qkv output) are stored, and converted, with one copy."""

from __future__ import annotations

import torch

__all__ = ["adjacent_kv", "converted_kv", "scatter_kv", "write_kv"]


def adjacent_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
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


def converted_kv(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v [T, W] in `dtype`; still side by side in one tensor when they were (one conversion, and
    `scatter_kv` then stores both with one copy)."""
    kv = adjacent_kv(k, v)
    if kv is None:
        return k.to(dtype), v.to(dtype)
    kv = kv.to(dtype)
    return kv[:, 0], kv[:, 1]


def scatter_kv(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor) -> None:
    """Store k, v [T, Hkv * D] at rows `index` [T] of rows [2 (K, V), Hkv, num_rows, D]; a one-plane
    store [1, ...] holds the keys only (the values are inside them)."""
    num_kv_heads, head_dim = rows.shape[1], rows.shape[-1]
    if rows.shape[0] == 1:
        rows[0].index_copy_(1, index, k.view(-1, num_kv_heads, head_dim).transpose(0, 1))
        return
    kv = adjacent_kv(k, v)
    if kv is not None:
        rows.index_copy_(2, index, kv.view(-1, 2, num_kv_heads, head_dim).permute(1, 2, 0, 3))
        return
    rows[0].index_copy_(1, index, k.view(-1, num_kv_heads, head_dim).transpose(0, 1))
    rows[1].index_copy_(1, index, v.view(-1, num_kv_heads, head_dim).transpose(0, 1))


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's k, v [T, Hkv * D] at their slots of cache [2 (or 1), Hkv, num_blocks, block_size, D]."""
    scatter_kv(cache.view(cache.shape[0], cache.shape[1], -1, cache.shape[-1]), k, v, slot_mapping)
