"""SiLU-and-mul (SwiGLU's gate) in Triton: [..., 2d] -> silu(first half) * second half."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmplug.layers.kernels import require_triton_device

__all__ = ["silu_and_mul"]

BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2d] (rows may be strided) -> silu(x[:, :d]) * x[:, d:] [N, d]."""
    require_triton_device(x, "silu_and_mul")
    num_rows, width = x.shape
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul needs contiguous columns")
    d = width // 2
    out = torch.empty(num_rows, d, dtype=x.dtype, device=x.device)
    if num_rows:
        _silu_and_mul_kernel[(num_rows, triton.cdiv(d, BLOCK))](x, out, x.stride(0), out.stride(0), d, BLOCK=BLOCK)
    return out
