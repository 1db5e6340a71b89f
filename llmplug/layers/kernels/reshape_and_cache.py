"""reshape_and_cache: store a step's keys and values at their slots of the paged cache (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmplug.layers.kernels import require_triton_device

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_vt, stride_kb, stride_ks, stride_vb, stride_vs,
    WIDTH: tl.constexpr, WIDTH_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cols = tl.arange(0, WIDTH_P)  # all KV heads of the token: [Hkv * D], contiguous in the cache slot
    ok = cols < WIDTH
    k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + cols, mask=ok)
    v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + cols, mask=ok)
    tl.store(k_cache_ptr + block * stride_kb + offset * stride_ks + cols, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + block * stride_vb + offset * stride_vs + cols, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def reshape_and_cache(
    k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, Hkv * D] (rows may be strided) into key_cache / value_cache
    [num_blocks, block_size, Hkv, D] at slots slot_mapping [T] (block * block_size + offset)."""
    require_triton_device(k, "reshape_and_cache")
    num_tokens, width = k.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if width != num_kv_heads * head_dim or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit a cache of {num_kv_heads} x {head_dim}")
    slot_strides = (head_dim, 1)  # one slot holds Hkv * D contiguous values
    if k.stride(1) != 1 or v.stride(1) != 1 or {key_cache.stride()[2:], value_cache.stride()[2:]} != {slot_strides}:
        raise ValueError("reshape_and_cache needs contiguous rows in k, v and each cache slot")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping,
        k.stride(0), v.stride(0), key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
        WIDTH=width, WIDTH_P=triton.next_power_of_2(width), BLOCK_SIZE=block_size,
    )
