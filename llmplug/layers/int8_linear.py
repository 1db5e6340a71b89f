"""W8A8 linear layers: int8 weights per output channel, activations quantized per token, int32 matmul.

`quantization: int8` gives every linear layer and the LM head an int8 copy of its weight (symmetric, one
float32 scale per output row: `w ~ q_w * s_w`). At run time each token's activation row is quantized the same
way (`x ~ q_x * s_x`, its own scale), the int8 matmul accumulates exactly in int32 (`torch._int_mm`: oneDNN's
s8s8s32 GEMM, AVX-512 VNNI where the CPU has it), and `y = acc * s_x * s_w` in float32, rounded once to the
model dtype. On 2 AVX-512 VNNI cores the int8 GEMM runs at ~550-1,000 GFLOP/s against ~150 for oneDNN's bf16
one (docs/quantization.md), so prefill and batched decode gain most.

Batch invariant by construction: the integer matmul is exact (so its kernel and blocking, which change with the
number of rows, cannot change a bit of the result) and everything else is per row (`int8_matmul_exact` probes
the exactness once per device). So the batch-invariant mode stays on with it.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from llmplug.layers.kernels.amx_linear import amx_int8_linear, amx_linear_enabled, pack_weight, packable

__all__ = ["Int8LinearMethod", "int8_matmul_exact", "quantize_rows"]

log = logging.getLogger(__name__)

INT8_MAX = 127  # symmetric range: -127..127 (no -128, so negating a row stays in range)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row of x [M, K] -> (q [M, K] int8, scale [M, 1] float32), x ~ q * scale.

    Every operation is per row and exactly rounded, so a row's result does not depend on the other rows.
    """
    # abs + amax in x's dtype (exact; torch's inf-norm reduction is ~10x slower on the CPU), then float32
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=1e-30).div_(INT8_MAX)
    # |x| / scale <= 127 (1 + 2^-24) / (1 - 2^-24) < 127.5: rounded, it stays in -127..127 without a clamp.
    # Converted first (a copy even of float32 x, which is not to be written): torch's mixed-dtype divide is slower
    q = x.to(torch.float32, copy=True).div_(scale).round_().to(torch.int8)
    return q, scale


@functools.lru_cache(maxsize=None)
def int8_matmul_exact(device_type: str) -> bool:
    """Whether `torch._int_mm` runs on `device_type` and equals an exact integer matmul for 1..33 rows (probed on
    the extremes, where a kernel with 16-bit intermediate sums would saturate, and on random values)."""
    try:
        device = torch.device(device_type)
        generator = torch.Generator().manual_seed(0)
        weight = torch.randint(-INT8_MAX, INT8_MAX + 1, (48, 96), dtype=torch.int8, generator=generator)
        weight[0] = INT8_MAX
        x = torch.randint(-INT8_MAX, INT8_MAX + 1, (33, 96), dtype=torch.int8, generator=generator)
        x[0] = INT8_MAX
        x[1] = -INT8_MAX
        expected = x.long() @ weight.long().T
        weight_t = weight.to(device).t()
        for rows in (1, 2, 17, 33):
            got = torch._int_mm(x[:rows].to(device), weight_t).cpu()
            if not torch.equal(got.long(), expected[:rows]):
                log.info("torch._int_mm on %s is not an exact integer matmul: int8 weights not used", device_type)
                return False
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        log.info("int8 matmul unavailable on %s: %s", device_type, error)
        return False
    return True


class Int8LinearMethod:
    """x W^T + b with W as int8 rows and x quantized per token; the result in x's dtype.

    Where llmplug's AMX kernels run (`amx_linear_enabled`), the codes are packed into AMX tiles for
    `amx_int8_linear` (TDPBSSD: the same quantization and int32 sums, the same float32 steps after, so the same bits;
    3-5x faster than the torch ops at prefill sizes, docs/kernels.md); elsewhere `torch._int_mm` (oneDNN) multiplies.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self.scale = (w.abs().amax(dim=1).clamp_(min=1e-30) / INT8_MAX).contiguous()  # [N] float32
        q = (w / self.scale[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.out_features = q.shape[0]
        self.packed = pack_weight(q) if amx_linear_enabled() and packable(q) else None  # AMX tiles, or None
        self.weight_t = None if self.packed is not None else q.contiguous().t()  # [K, N] view: oneDNN's layout

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, K]
        if self.packed is not None:  # float16 rows quantize and scale as their float32 values do: the same bits
            inputs = rows if rows.dtype in (torch.bfloat16, torch.float32) else rows.float()
            y = amx_int8_linear(inputs, self.packed, self.scale, bias, self.out_features).to(x.dtype)
        else:
            q, scale = quantize_rows(rows)
            # converted to float32 first: an int32 x float32 multiply takes torch's slower mixed-dtype loop
            y = torch._int_mm(q, self.weight_t).float().mul_(scale).mul_(self.scale)  # [M, N] float32
            if bias is not None:
                y += bias
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def __repr__(self) -> str:
        return "int8(w8a8, per-token activations)"
