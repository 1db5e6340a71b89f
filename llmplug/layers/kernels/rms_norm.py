"""RMSNorm, optionally fused with the residual add before it (Triton): one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmplug.layers.kernels import require_triton_device

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, out_ptr, weight_ptr, stride_x, stride_r, stride_o, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:  # the sum, rounded to x's dtype as torch's add would, is both stored and normalized
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * inv_rms * weight).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [N, C] -> RMSNorm(x) [N, C]; with `residual`, x + residual is written into x first and normalized.

    Rows of x, residual may be strided (columns contiguous); the result is a new contiguous tensor.
    """
    require_triton_device(x, "rms_norm")
    num_rows, n_cols = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs contiguous columns")
    out = torch.empty(num_rows, n_cols, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    _rms_norm_kernel[(num_rows,)](
        x, x if residual is None else residual, out, weight,
        x.stride(0), 0 if residual is None else residual.stride(0), out.stride(0), n_cols, eps,
        BLOCK=triton.next_power_of_2(n_cols), HAS_RESIDUAL=residual is not None,
    )
    return out
