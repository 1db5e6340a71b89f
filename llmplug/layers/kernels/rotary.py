"""Rotary embedding applied in place (Triton), neox (rotate-half) or interleaved pairs: one program per token.

cos_sin_cache is the layer's table [max_position, rotary_dim]: the cos of the rotary_dim / 2 angles,
then their sin. Neox style rotates the pair (i, i + rotary_dim / 2), interleaved style (2i, 2i + 1);
dims past rotary_dim are left alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmplug.layers.kernels import require_triton_device

__all__ = ["rotary_embedding_"]


@triton.jit
def _rotary_kernel(
    x_ptr, positions_ptr, cache_ptr, stride_xt, stride_xh, stride_cache, num_heads,
    HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr, IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_P)
    pair_ok = pairs < HALF
    cos = tl.load(cache_ptr + position * stride_cache + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + position * stride_cache + HALF + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    if IS_NEOX:
        first = pairs
        second = pairs + HALF
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    heads = tl.arange(0, HEADS_P)
    base = x_ptr + token * stride_xt + heads[:, None] * stride_xh  # [HEADS_P, 1]
    ok = (heads[:, None] < num_heads) & pair_ok[None, :]
    x1 = tl.load(base + first[None, :], mask=ok, other=0.0).to(tl.float32)  # [HEADS_P, HALF_P]
    x2 = tl.load(base + second[None, :], mask=ok, other=0.0).to(tl.float32)
    out_ty = x_ptr.dtype.element_ty
    tl.store(base + first[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=ok)
    tl.store(base + second[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=ok)


def rotary_embedding_(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox_style: bool
) -> torch.Tensor:
    """Rotate x [T, heads, D] in place (q and k heads together; tokens and heads may be strided); returns x."""
    require_triton_device(x, "rotary_embedding_")
    num_tokens, num_heads, _ = x.shape
    if x.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary_embedding_ needs head dims contiguous in x and the cos/sin table")
    half = cos_sin_cache.shape[1] // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, positions, cos_sin_cache, x.stride(0), x.stride(1), cos_sin_cache.stride(0), num_heads,
            HALF=half, HALF_P=triton.next_power_of_2(half), HEADS_P=triton.next_power_of_2(num_heads),
            IS_NEOX=is_neox_style,
        )
    return x
