"""Absolute position embeddings, added to the token embeddings before the first layer.

- `LearnedPositionEmbedding`: a trained table (GPT-2, GPT-Neo, OPT); `offset` shifts the row a
  position reads (OPT's table starts at row 2), and the table is split over the tensor-parallel ranks
  like the vocabulary.
- `SinusoidalPositionEmbedding`: a fixed table [sin | cos], with the same offset: frequencies
  10000^(-i / (d/2 - 1)) as tensor2tensor and fairseq space them (XGLM), or 10000^(-2i / d) as the
  Transformer paper does (`paper_frequencies`, CTRL).
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


def sinusoidal_table(num_positions: int, dim: int, paper_frequencies: bool = False) -> torch.Tensor:
    """[num_positions, dim] float32: sin of dim / 2 geometric frequencies, then their cos (odd dim: a zero column).

    Frequencies 10000^(-i / (dim / 2 - 1)), or 10000^(-2i / dim) with `paper_frequencies`.
    """
    half = dim // 2
    if paper_frequencies:
        freqs = 1 / torch.pow(10000, torch.arange(0, 2 * half, 2, dtype=torch.int64).float() / dim)
    else:
        step = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, dtype=torch.int64).float() * -step)
    angles = torch.arange(num_positions, dtype=torch.int64).float()[:, None] * freqs[None, :]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)
    return torch.nn.functional.pad(table, (0, dim % 2))


class SinusoidalPositionEmbedding(nn.Module):
    """Row `position + offset` of the fixed sinusoidal table."""

    def __init__(
        self, num_positions: int, embedding_dim: int, offset: int = 0, paper_frequencies: bool = False
    ) -> None:
        super().__init__()
        self.offset = offset
        # recomputed from the config, never read from a checkpoint
        table = sinusoidal_table(num_positions + offset, embedding_dim, paper_frequencies)
        self.register_buffer("table", table, persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> [T, embedding_dim] in float32 (the caller casts)."""
        return self.table.index_select(0, positions + self.offset)
