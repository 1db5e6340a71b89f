"""W4A8: GGUF Q4_0 / Q4_1 weights times int8 activations, with llmplug's CPU kernel (`llmplug_cpu::w4a8_matmul`,
native/w4a8.cpp) — the arithmetic llama.cpp uses for these blocks.

Each row of x is quantized per 32 k as llama.cpp's Q8_1 does (scale dx = max |x| / 127, codes round(x / dx), their
sum sx); a block's dot product with a column's codes q (w = d q + m) is then an exact integer, and the blocks add in
k order in float32: t = fma(dot, d, sx * m), acc = fma(t, dx, acc). The integer part is exact whichever instruction
computes it (AVX512-VNNI, AVX-512, AMX-INT8 or a plain loop) and the float part is the same operations in the same
order, so a row's bits depend neither on M, nor on the path, the thread or the CPU: batch invariant by
construction, and the one-row decode step takes the vector path while a batch takes AMX tiles.

It reads 0.625 bytes a weight, as the file's blocks, and does no per-weight float work, so a decode step of one row
runs at memory speed, where the bf16-activation kernel (`NativeInt4`) is bound by decoding every weight to bfloat16.
The price is the activations' rounding to 8 bits a block, the error llama.cpp's own matmul makes (docs/kernels.md,
"W4A8", states the accuracy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmplug.layers.kernels.int4_matmul import float16_scales_and_minimums
from llmplug.layers.kernels.native import native_available, ops

if TYPE_CHECKING:  # llmplug.layers.quantization chooses this kernel: no import back at run time
    from llmplug.layers.quantization import Int4Groups

__all__ = ["W4A8", "W4A8_ENV", "w4a8_enabled"]

W4A8_ENV = "LLMPLUG_CPU_W4A8"  # "0": int4 copies keep bfloat16 activations (NativeInt4), the file's weights exactly
_BLOCK, _COLUMNS = 32, 16  # k a block (one d, m, dx), columns a group (one vector of sums)


def w4a8_enabled() -> bool:
    """Whether bfloat16 int4 copies of Q4_0 / Q4_1 blocks use this kernel: the native kernels are built and
    `LLMPLUG_CPU_W4A8` is not "0"."""
    return os.environ.get(W4A8_ENV, "1") != "0" and native_available()


@dataclass(frozen=True, slots=True)
class W4A8:
    """An [N, K] weight as w4a8_matmul's packed blocks: [ceil(N / 16), K / 32, 320] uint8, for 16 columns and 32 k
    the 256 bytes of codes (byte 4c + j of the i-th 64: column c's k = 4i + j low, k = 16 + 4i + j high), then 16 d
    and 16 m as float16 (`scales`, `zeros`: views of them)."""

    packed: torch.Tensor
    out_features: int
    num_planes: int = 1

    @classmethod
    def pack(cls, groups: Int4Groups) -> "W4A8 | None":
        """The groups packed, where they are one plane of float16 d and m (w = d q + m, m = zero - 8 d exactly: GGUF
        Q4_0 and Q4_1 blocks); None for any other groups."""
        narrow = float16_scales_and_minimums(groups) if groups.num_planes == 1 else None
        if narrow is None or groups.group_size % _BLOCK:
            return None
        d, m = narrow[0][0], narrow[1][0]  # [N, G] float16
        n, k = groups.q.shape[1:]
        pad = -n % _COLUMNS
        per_block = groups.group_size // _BLOCK  # a group's parameters repeat for each of its blocks
        q = torch.nn.functional.pad(groups.q[0], (0, 0, 0, pad))  # [N', K]
        # [N'/16, 16 c, K/32, 2 halves, 4 i, 4 j] -> [N'/16, K/32, i, c, j]: low nibble the first half
        q = q.view(-1, _COLUMNS, k // _BLOCK, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
        codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, k // _BLOCK, 256)
        params = [torch.nn.functional.pad(p.repeat_interleave(per_block, dim=1), (0, 0, 0, pad)) for p in (d, m)]
        params = [p.view(-1, _COLUMNS, k // _BLOCK).transpose(1, 2).contiguous().view(torch.uint8) for p in params]
        return cls(torch.cat([codes, *params], dim=-1).contiguous(), n)

    @property
    def scales(self) -> torch.Tensor:
        """d, [N / 16, K / 32, 16] float16 (a view: writing it changes the weight)."""
        return self.packed[..., 256:288].view(torch.float16)

    @property
    def zeros(self) -> torch.Tensor:
        """m, [N / 16, K / 32, 16] float16 (a view)."""
        return self.packed[..., 288:320].view(torch.float16)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] -> [M, N] in x's dtype (float32 or bfloat16); each row's bits independent of M and the CPU."""
        return ops().w4a8_matmul(x, self.packed, self.out_features)

