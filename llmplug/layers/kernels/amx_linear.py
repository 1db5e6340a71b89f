"""Dense bfloat16 linear layers on Intel AMX with llmplug's own kernel (`llmplug_cpu::amx_linear`,
native/amx_linear.cpp), and the int8 (W8A8) product of `quantization: int8` (`llmplug_cpu::amx_int8_linear`).

oneDNN's AMX kernels sum a row in an order that depends on the number of rows, so in batch-invariant mode they
run by row plans of 32-row tiles, 4-27x slower than one call at prefill sizes (docs/kernels.md). This kernel sums
each output over k in one fixed order (AMX tile products, 32 k at a time, in order), whatever the number of rows,
the tile or the thread: batch invariant by construction, no probe needed, and as fast as oneDNN's one call.

Used in batch-invariant mode where AMX runs (`amx_linear_enabled`): the build has AMX-BF16 and AMX-INT8, Linux
lends the tile state, and neither `LLMPLUG_CPU_AMX=0` nor a oneDNN ISA cap below AMX (`ONEDNN_MAX_CPU_ISA`, which
the tests use to run each kernel family a CPU has) says otherwise. The int4 kernel's AMX path and the int8 layers
follow the same switch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from llmplug.layers.kernels.native import native_available, ops

__all__ = [
    "AMX_ENV",
    "amx_int8_linear",
    "amx_linear",
    "amx_linear_enabled",
    "amx_linear_rotary",
    "amx_linear_silu_and_mul",
    "pack_weight",
    "packable",
]

AMX_ENV = "LLMPLUG_CPU_AMX"  # "auto" (default): AMX where it runs; "0": never (read by the kernels, amx.h)
_TILE_BYTES, _COLUMN_TILES = 64, 32  # bytes of k a tile row holds; outputs a task computes (the packed rows' multiple)


@functools.cache
def amx_linear_enabled() -> bool:
    """Whether llmplug's kernels use AMX in this process (decided once, by the kernels: native/amx.h)."""
    return native_available() and bool(ops().amx_enabled())


def _depth(weight: torch.Tensor) -> int:
    """k a tile row holds: 32 bf16 (TDPBF16PS's pairs), 64 int8 (TDPBSSD's quads)."""
    return _TILE_BYTES // weight.element_size()


def packable(weight: torch.Tensor) -> bool:
    """Whether the kernels take this weight: 2-D bfloat16 (amx_linear) or int8 (amx_int8_linear) on the CPU, K a
    multiple of a tile row's k (32, 64)."""
    return (weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.int8) and weight.device.type == "cpu"
            and weight.shape[1] % _depth(weight) == 0)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernels' tiles [N' / 16, K / D, 16, D], N' = N rounded up to 32 with zero rows, D = 32 (bf16) or
    64 (int8): tile (j, t) row p holds k = D t + V p .. + V - 1 of outputs 16 j .. 16 j + 15, V = 2 (bf16) or 4
    (int8) values of k to a 4-byte word (AMX's B-tile layout)."""
    out_features, in_features = weight.shape
    depth, per_word = _depth(weight), 4 // weight.element_size()
    rows = -(-out_features // _COLUMN_TILES) * _COLUMN_TILES
    padded = F.pad(weight.detach(), (0, 0, 0, rows - out_features))
    tiles = padded.view(rows // 16, 16, in_features // depth, 16, per_word).permute(0, 2, 3, 1, 4)
    return tiles.reshape(rows // 16, in_features // depth, 16, depth).contiguous()


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 times the packed weight, plus bias -> [..., out_features] bf16."""
    rows = x.reshape(-1, x.shape[-1])
    return ops().amx_linear(rows, packed, bias, out_features).view(*x.shape[:-1], out_features)


def amx_linear_silu_and_mul(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """silu_and_mul of x [..., K] times gate_up's packed weight (out_features = 2 d, d a multiple of 16) -> [..., d]
    bf16, bit for bit the two calls', without the [..., 2 d] product in memory between them."""
    rows = x.reshape(-1, x.shape[-1])
    out = ops().amx_linear_silu_and_mul(rows, packed, bias, out_features)
    return out.view(*x.shape[:-1], out_features // 2)


def amx_linear_rotary(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, cos: torch.Tensor,
    sin: torch.Tensor, rotary_columns: int, head_dim: int,
) -> torch.Tensor:
    """x [T, K] bf16 times a qkv weight's packed tiles, plus bias, with the first `rotary_columns` outputs (q and k
    heads of head_dim, a multiple of 32) rotated rotate-half by cos and sin (RotaryCosSin's, [T, 1, head_dim] bf16)
    -> [T, out_features] bf16, bit for bit `amx_linear` then `rotary_embedding` of those heads, without writing the
    heads and reading them back."""
    return ops().amx_linear_rotary(x, packed, bias, out_features, cos, sin, rotary_columns, head_dim)


def amx_int8_linear(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                    out_features: int) -> torch.Tensor:
    """x [..., K] (bf16 or float32) times int8 codes packed by `pack_weight`, scaled per output (float32 [N]), plus
    bias -> [..., out_features] in x's dtype: the rows quantized per token and summed exactly in int32 with TDPBSSD
    (Int8LinearMethod's W8A8 product, bit for bit)."""
    rows = x.reshape(-1, x.shape[-1])
    return ops().amx_int8_linear(rows, packed, weight_scale, bias, out_features).view(*x.shape[:-1], out_features)
