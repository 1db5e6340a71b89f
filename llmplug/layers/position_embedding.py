"""Absolute position embeddings, added to the token embeddings before the first layer.

- `LearnedPositionEmbedding`: a trained table (GPT-2, GPT-Neo, OPT); `offset` shifts the row a
  position reads (OPT's table starts at row 2), and the table is split over the tensor-parallel ranks
  like the vocabulary.
- `SinusoidalPositionEmbedding`: the fixed tensor2tensor table [sin | cos] (XGLM), with the same offset.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmplug.layers.vocab_embedding import VocabParallelEmbedding

__all__ = ["LearnedPositionEmbedding", "SinusoidalPositionEmbedding", "sinusoidal_table"]


class LearnedPositionEmbedding(VocabParallelEmbedding):
    """Row `position + offset` of a learned [num_positions + offset, hidden] table."""

    def __init__(self, num_positions: int, embedding_dim: int, offset: int = 0, prefix: str = "") -> None:
        super().__init__(num_positions + offset, embedding_dim, prefix)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> [T, embedding_dim]."""
        return super().forward(positions + self.offset if self.offset else positions)


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """[num_positions, dim] float32: sin of dim / 2 geometric frequencies, then their cos (odd dim: a zero column)."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(num_positions, dtype=torch.int64).float()[:, None] * freqs[None, :]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    return torch.nn.functional.pad(table, (0, dim % 2))


class SinusoidalPositionEmbedding(nn.Module):
    """Row `position + offset` of the fixed sinusoidal table."""

    def __init__(self, num_positions: int, embedding_dim: int, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        # recomputed from the config, never read from a checkpoint
        self.register_buffer("table", sinusoidal_table(num_positions + offset, embedding_dim), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> [T, embedding_dim] in float32 (the caller casts)."""
        return self.table.index_select(0, positions + self.offset)
