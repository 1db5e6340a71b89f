"""The 2D (axial) rotary of vision towers: a patch's q and k rotated by its row and its column.

Half of the rotated frequencies turn with one axis's coordinate, the other half with the other's; the towers differ
in data only (`axial_angles`' flags): Pixtral rotates rows by the even frequencies of a 1D rotary over the head and
columns by the odd ones, rotate-half pairs; Llama 4 rotates columns first, both axes by the same (even) frequencies,
coordinates counted from 1, interleaved pairs (`interleaved_rotation`), its class token unrotated.
"""

from __future__ import annotations

import torch

from llmplug.layers.rotary import RotaryCosSin

__all__ = ["axial_angles", "interleaved_rotation"]


def axial_angles(rows: int, cols: int, head_dim: int, theta: float, *, columns_first: bool = False,
                 shared_frequencies: bool = False, offset: int = 0) -> torch.Tensor:
    """[rows * cols, head_dim / 2] rotary angles of a rows x cols grid, row-major: the first head_dim / 4 the first
    axis's coordinate (+ `offset`) times the even frequencies of a 1D rotary over `head_dim`, the rest the second
    axis's times the odd ones (or the even ones again with `shared_frequencies`). The first axis is the row, or the
    column with `columns_first`."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [D / 2]
    first_freq = inv_freq[0::2]
    second_freq = first_freq if shared_frequencies else inv_freq[1::2]
    row, col = torch.meshgrid(torch.arange(rows) + offset, torch.arange(cols) + offset, indexing="ij")
    first, second = (col, row) if columns_first else (row, col)
    return torch.cat([first.flatten()[:, None] * first_freq, second.flatten()[:, None] * second_freq], dim=-1)


def interleaved_rotation(angles: torch.Tensor, dtype: torch.dtype) -> RotaryCosSin:
    """The rotation of angles [N, D / 2] over interleaved pairs (x0, x1), (x2, x3), ... of q and k [..., N, heads, D]
    (the complex product of transformers' `view_as_complex` rotaries)."""
    cos, sin = angles.cos(), angles.sin()
    return RotaryCosSin(cos.repeat_interleave(2, dim=-1)[:, None].to(dtype),
                        torch.stack([-sin, sin], dim=-1).flatten(-2)[:, None].to(dtype), is_neox_style=False)
