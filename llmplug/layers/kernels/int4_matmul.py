"""Weight-only int4 matmul with llmplug's own CPU kernel (`llmplug_cpu::int4_matmul`, native/int4.cpp).

The same interface as `PackedInt4` (torch's `_weight_int4pack_mm_for_cpu`), with two guarantees that one lacks:

- batch invariant by construction: each output element is one dot product whose every add is in a fixed order,
  whatever the number of rows, the tile or the thread that computes it (no probe needed);
- exact weights: each weight is what `Int4Groups.dequantize` gives (float32 scales and zeros, the planes added),
  used as is for float32 activations and rounded once to bfloat16 for bfloat16 ones. `pack(..., exact=False)`
  rounds the scales and zeros to bfloat16 first (as PackedInt4 does for bf16): 0.625 bytes a weight instead of
  0.75, which is what a memory-bound decode step costs.

Each weight is decoded once per call and reused by every row of x, so small batches (decode) are cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmplug.layers.kernels.native import native_available, ops

if TYPE_CHECKING:  # llmplug.layers.quantization will choose this kernel: no import back at run time
    from llmplug.layers.quantization import Int4Groups

__all__ = ["NATIVE_INT4_DTYPES", "NativeInt4", "native_int4_available"]

NATIVE_INT4_DTYPES = (torch.float32, torch.bfloat16)  # the activation dtypes the kernel takes
_BLOCK = 32  # k per 16 bytes of codes in the kernel's layout


def native_int4_available() -> bool:
    """Whether llmplug's CPU kernels are built (they include the int4 matmul)."""
    return native_available()


@dataclass(frozen=True, slots=True)
class NativeInt4:
    """An [N, K] weight in the kernel's layout: codes [N, P, K / 2] uint8, two a byte (in each run of 32 k, byte b
    holds k = b in its low nibble and k = b + 16 in its high one); scales and zeros [N, P, K / group_size], float32
    (exact) or bfloat16."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    dtype: torch.dtype

    @property
    def num_planes(self) -> int:
        """How many int4 planes add up to the weight."""
        return self.qweight.shape[1]

    @classmethod
    def pack(cls, groups: Int4Groups, dtype: torch.dtype, exact: bool = True) -> "NativeInt4":
        """Pack `groups` for activations of `dtype` (float32 or bfloat16); the scales and zeros stay float32, or
        with `exact=False` are rounded to bfloat16 (fewer bytes to read, the weights no longer `dequantize()`'s)."""
        if dtype not in NATIVE_INT4_DTYPES:
            raise ValueError(f"the native int4 kernel takes float32 or bfloat16 activations, not {dtype}")
        if groups.group_size % _BLOCK:
            raise ValueError(f"the native int4 kernel needs a group size that is a multiple of 32, not "
                             f"{groups.group_size}")
        planes, n, k = groups.q.shape
        q = groups.q.permute(1, 0, 2).reshape(n, planes, k // _BLOCK, 2, _BLOCK // 2)  # [N, P, blocks, half, 16]
        qweight = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, planes, k // 2).contiguous()

        def per_row(t: torch.Tensor) -> torch.Tensor:  # [P, N, G] -> [N, P, G]
            return t.permute(1, 0, 2).to(torch.float32 if exact else torch.bfloat16).contiguous()

        return cls(qweight, per_row(groups.scale), per_row(groups.zero), groups.group_size, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] -> [M, N] in x's dtype; float32 dot products, each row's bits independent of M."""
        return ops().int4_matmul(x, self.qweight, self.scales, self.zeros, self.group_size)
