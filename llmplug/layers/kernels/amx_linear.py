"""Dense bfloat16 linear layers on Intel AMX with llmplug's own kernel (`llmplug_cpu::amx_linear`,
native/amx_linear.cpp).

oneDNN's AMX kernels sum a row in an order that depends on the number of rows, so in batch-invariant mode they
run by row plans of 32-row tiles, 4-27x slower than one call at prefill sizes (docs/kernels.md). This kernel sums
each output over k in one fixed order (AMX tile products, 32 k at a time, in order), whatever the number of rows,
the tile or the thread: batch invariant by construction, no probe needed, and as fast as oneDNN's one call.

Used in batch-invariant mode where AMX-BF16 runs (`amx_linear_enabled`): the build has it, Linux lends the tile
state, and neither `LLMPLUG_CPU_AMX=0` nor a oneDNN ISA cap below AMX (`ONEDNN_MAX_CPU_ISA`, which the tests use
to run each kernel family a CPU has) says otherwise. The int4 kernel's AMX path follows the same switch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from llmplug.layers.kernels.native import native_available, ops

__all__ = ["AMX_ENV", "amx_linear", "amx_linear_enabled", "pack_weight", "packable"]

AMX_ENV = "LLMPLUG_CPU_AMX"  # "auto" (default): AMX where it runs; "0": never (read by the kernels, amx.h)
_TILE_DEPTH, _COLUMN_TILES = 32, 32  # k a tile product sums; outputs a task computes (the packed rows' multiple)


@functools.cache
def amx_linear_enabled() -> bool:
    """Whether llmplug's kernels use AMX in this process (decided once, by the kernels: native/amx.h)."""
    return native_available() and bool(ops().amx_enabled())


def packable(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: 2-D bfloat16 on the CPU, K a multiple of 32."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[1] % _TILE_DEPTH == 0)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's tiles [N' / 16, K / 32, 16, 32], N' = N rounded up to 32 with zero rows: tile (j, t)
    row p holds the pair k = 32 t + 2 p, + 1 of outputs 16 j .. 16 j + 15 (AMX's B-tile layout)."""
    out_features, in_features = weight.shape
    rows = -(-out_features // _COLUMN_TILES) * _COLUMN_TILES
    padded = F.pad(weight.detach(), (0, 0, 0, rows - out_features))
    tiles = padded.view(rows // 16, 16, in_features // _TILE_DEPTH, 16, 2).permute(0, 2, 3, 1, 4)
    return tiles.reshape(rows // 16, in_features // _TILE_DEPTH, 16, _TILE_DEPTH).contiguous()


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., K] bf16 times the packed weight, plus bias -> [..., out_features] bf16."""
    rows = x.reshape(-1, x.shape[-1])
    return ops().amx_linear(rows, packed, bias, out_features).view(*x.shape[:-1], out_features)
