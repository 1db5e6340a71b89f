"""Weight-only int4 matmul with llmplug's own CPU kernel (`llmplug_cpu::int4_matmul`, native/int4.cpp).

The same interface as `PackedInt4` (torch's `_weight_int4pack_mm_for_cpu`), with two guarantees that one lacks:

- batch invariant by construction: each output element is one dot product whose every add is in a fixed order,
  whatever the number of rows, the tile or the thread that computes it (no probe needed);
- exact weights: each weight is what `Int4Groups.dequantize` gives (in float32 the product, the zero added, the
  planes added), used as is for float32 activations and rounded once to bfloat16 for bfloat16 ones.

A decode step costs the bytes it reads, so `pack` stores the groups in the fewest bytes that keep those weights
bit for bit (group size 32):

- GGUF Q4_0 / Q4_1 (float16 d and m): codes and float16 scales and minimums, 0.625 bytes a weight;
- GGUF Q8_0 (two planes): int8 codes and a float16 scale, 1.0625 bytes a weight instead of two planes' 1.5;
- anything else (e.g. `quantize_int4`'s float32 scales): float32 scales and zeros, 0.75 bytes a weight a plane.

`pack(..., exact=False)` rounds the scales and zeros to bfloat16 first (as PackedInt4 does for bf16): 0.625 bytes
a weight for any groups, the weights no longer `dequantize()`'s.

Each weight is decoded once per call and reused by every row of x, so small batches (decode) are cheap.

Where the CPU and the build have AMX (native/amx.h; `LLMPLUG_CPU_AMX=0`: never), bfloat16 activations compute
with AMX tiles at every row count: the same weights, another float32 summation order (so other bits, as batch
invariant); 1.0-1.8x faster at 4 rows, 2-5x at 32, 1.1-1.3x slower at one (docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmplug.layers.kernels.native import native_available, ops

if TYPE_CHECKING:  # llmplug.layers.quantization will choose this kernel: no import back at run time
    from llmplug.layers.quantization import Int4Groups

__all__ = ["NATIVE_INT4_DTYPES", "NativeInt4", "float16_scales_and_minimums", "native_int4_available"]

NATIVE_INT4_DTYPES = (torch.float32, torch.bfloat16)  # the activation dtypes the kernel takes
_BLOCK = 32  # k per 16 bytes of codes in the kernel's layout
_CHECK_ROWS = 4096  # rows of a Q8_0 weight checked at a time against dequantize()


def native_int4_available() -> bool:
    """Whether llmplug's CPU kernels are built (they include the int4 matmul)."""
    return native_available()


@dataclass(frozen=True, slots=True)
class NativeInt4:
    """An [N, K] weight in one of the kernel's layouts:

    - int4 planes: codes [N, P, K / 2] uint8, two a byte (in each run of 32 k, byte b holds k = b in its low nibble
      and k = b + 16 in its high one); scales and zeros [N, P, K / group_size], float32, or float16 scales with
      float16 minimums m in `zeros` (the zero m + 8 * scale, rounded once in float32), or bfloat16 (`exact=False`);
    - Q8_0's two planes as one: codes [N, K] int8, w = q8 * scale in float32; scales [N, K / group_size] float16 or
      float32 (bfloat16 with `exact=False`), zeros [N, 0].
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    dtype: torch.dtype

    @property
    def num_planes(self) -> int:
        """How many int4 planes add up to the weight (2 for int8 codes: the Q8_0 planes they stand for)."""
        return 2 if self.qweight.dtype == torch.int8 else self.qweight.shape[1]

    @classmethod
    def pack(cls, groups: Int4Groups, dtype: torch.dtype, exact: bool = True) -> "NativeInt4":
        """Pack `groups` for activations of `dtype` (float32 or bfloat16) in the fewest bytes that keep
        `dequantize()`'s weights bit for bit: int8 codes where the groups are Q8_0's two planes, float16 group
        parameters where they hold them exactly, else float32. With `exact=False` the scales and zeros are rounded to
        bfloat16 first (the weights no longer `dequantize()`'s; fewer bytes where float16 is not exact)."""
        if dtype not in NATIVE_INT4_DTYPES:
            raise ValueError(f"the native int4 kernel takes float32 or bfloat16 activations, not {dtype}")
        if groups.group_size % _BLOCK:
            raise ValueError(f"the native int4 kernel needs a group size that is a multiple of 32, not "
                             f"{groups.group_size}")
        if not exact:
            groups = _rounded_to_bfloat16(groups)
        param_dtype = torch.float32 if exact else torch.bfloat16
        q8 = _q8_0_codes(groups)
        if q8 is not None:
            codes, scale = q8
            scales = _narrowed(scale, param_dtype)
            return cls(codes, scales, scales.new_empty(scales.shape[0], 0), groups.group_size, dtype)
        return cls(_int4_codes(groups), *_int4_params(groups, param_dtype), groups.group_size, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] -> [M, N] in x's dtype; float32 dot products, each row's bits independent of M."""
        return ops().int4_matmul(x, self.qweight, self.scales, self.zeros, self.group_size)


def _rounded_to_bfloat16(groups: Int4Groups) -> Int4Groups:
    """The groups with their scales and zeros rounded to bfloat16 (`exact=False`); type(groups): no import back."""
    scale, zero = (t.to(torch.bfloat16).float() for t in (groups.scale, groups.zero))
    return type(groups)(groups.q, scale, zero, groups.group_size)


def _int4_codes(groups: Int4Groups) -> torch.Tensor:
    """[P, N, K] codes -> [N, P, K / 2] bytes in the kernel's order."""
    planes, n, k = groups.q.shape
    q = groups.q.permute(1, 0, 2).reshape(n, planes, k // _BLOCK, 2, _BLOCK // 2)  # [N, P, blocks, half, 16]
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, planes, k // 2).contiguous()


def _per_row(t: torch.Tensor) -> torch.Tensor:  # [P, N, G] -> [N, P, G]
    return t.permute(1, 0, 2).contiguous()


def float16_scales_and_minimums(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The groups' scales d and minimums m = zero - 8 d [P, N, G] as float16, where d is a float16 and m + 8 d (8 d
    exact, one rounding in float32) gives back every zero bit for bit: GGUF Q4_0 and Q4_1 blocks; else None."""
    scale, zero = groups.scale, groups.zero
    if not _holds(scale, torch.float16):
        return None
    minimum = (zero - 8 * scale).to(torch.float16)
    return (scale.to(torch.float16), minimum) if _same_bits(minimum.float() + 8 * scale, zero) else None


def _int4_params(groups: Int4Groups, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros [N, P, G]: float16 scales and minimums (float16_scales_and_minimums) where they hold the
    groups exactly and `dtype` is float32, else in `dtype`."""
    narrow = float16_scales_and_minimums(groups) if dtype == torch.float32 else None
    if narrow is not None:
        return _per_row(narrow[0]), _per_row(narrow[1])
    return _per_row(groups.scale.to(dtype)), _per_row(groups.zero.to(dtype))


def _q8_0_codes(groups: Int4Groups) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Int8 codes [N, K] and scales [N, G] (float32) whose products q8 * d, each rounded once in float32, are
    `groups.dequantize()` bit for bit (signed zeros included: proved from the scales where it can be, else checked
    weight by weight), where the groups are Q8_0's two planes (16 d (hi - 8) + [d (lo - 8) + 8 d],
    llmplug.loaders.gguf); else None."""
    if groups.num_planes != 2:
        return None
    (scale_hi, scale), (zero_hi, zero) = groups.scale, groups.zero
    planes = (scale_hi, 16 * scale), (zero, 8 * scale), (zero_hi, torch.zeros_like(zero_hi))
    if not all(_same_bits(a, b) for a, b in planes):
        return None  # not Q8_0's planes, bit for bit (+0 zeros included: the proof below counts on them)
    codes = (groups.q[0].to(torch.int16) * 16 + groups.q[1] - 128).to(torch.int8)  # [N, K]
    if _products_are_the_planes_sums(codes, scale, groups.group_size):
        return codes, scale
    for start in range(0, codes.shape[0], _CHECK_ROWS):  # a row range at a time: the head is large
        rows = slice(start, start + _CHECK_ROWS)
        part = type(groups)(groups.q[:, rows], groups.scale[:, rows], groups.zero[:, rows], groups.group_size)
        products = codes[rows].float() * scale[rows].repeat_interleave(groups.group_size, dim=-1)
        if not _same_bits(products, part.dequantize()):
            return None
    return codes, scale


def _products_are_the_planes_sums(codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> bool:
    """Whether q8 * d equals 16 d (hi - 8) + [d (lo - 8) + 8 d] in float32 bit for bit without computing them: true
    where every d is a float16 (11 significant bits, so each product and partial sum is exact) and positive, or +0
    with no negative code in its group (a zero's sign then agrees: +0 both ways). Real Q8_0 files pass."""
    if not _holds(scale, torch.float16):
        return False
    positive = (scale > 0) & scale.isfinite()
    if bool(positive.all()):
        return True
    signed_zero_bits = scale.view(torch.int32) == 0  # +0 exactly
    no_negative_code = codes.unflatten(-1, (-1, group_size)).amin(-1) >= 0  # [N, G]
    return bool((positive | (signed_zero_bits & no_negative_code)).all())


def _narrowed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as float16 where that is exact (and `dtype` is float32), else as `dtype`."""
    return t.to(torch.float16 if dtype == torch.float32 and _holds(t, torch.float16) else dtype).contiguous()


def _holds(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `dtype` holds every value of float32 `t` exactly (signed zeros included; no NaN)."""
    return _same_bits(t.to(dtype).float(), t)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))
