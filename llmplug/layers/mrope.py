"""Multimodal rotary position embeddings (M-RoPE, Qwen2-VL's): three position streams — temporal, height, width.

Each token has three positions. Text tokens have the same one on all three streams (plain RoPE); an image's
tokens take (t, h, w) coordinates of its grid of merged patches, offset by the position where the image starts,
and the text after an image resumes at that start plus the image's largest side. The rotary frequencies are split
in `mrope_section` consecutive groups (summing to rotary_dim / 2): group i is rotated by stream i's positions.
Qwen3-VL's interleaved layout instead cycles t, h, w over the frequencies: frequency j follows h when j % 3 == 1 and
j < 3 * section[1], w when j % 3 == 2 and j < 3 * section[2], t otherwise.

A prompt's positions are computed once per request (`mrope_input_positions`); a token past the prompt (a generated
one) is at its sequence position plus the prompt's `delta` (its last position + 1 - its length, <= 0) on every
stream, so decoding never needs the images again. A model without images passes positions [T] and gets plain RoPE.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from llmplug.layers.rotary import RotaryCosSin, RotaryEmbedding, RotaryPositions, build_cos_sin_cache

__all__ = ["MRotaryEmbedding", "get_mrope", "mrope_input_positions"]

NUM_STREAMS = 3  # temporal, height, width


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose frequencies each follow one of the three position streams (`mrope_section`: consecutive groups,
    or interleaved)."""

    def __init__(self, head_size: int, rotary_dim: int, cos_sin_cache: torch.Tensor, mrope_section: Sequence[int],
                 is_neox_style: bool = True, interleaved: bool = False) -> None:
        super().__init__(head_size, rotary_dim, cos_sin_cache, is_neox_style)
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to rotary_dim / 2 = {rotary_dim // 2}")
        self.mrope_section, self.interleaved = tuple(mrope_section), interleaved
        # the stream of each of the rotary_dim / 2 frequencies, for the cos and the sin half
        streams = stream_of_frequency(mrope_section, rotary_dim // 2, interleaved)
        self.register_buffer("stream_of_column", torch.cat((streams, streams)), persistent=False)  # [rotary_dim]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryCosSin | RotaryPositions:
        """One step's rotation for `positions` [3, T] (or [T]: the same position on every stream)."""
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        rows = self.cos_sin_cache[positions]  # [3, T, rotary_dim]: each stream's cos | sin
        index = self.stream_of_column.expand(1, positions.shape[1], -1)  # [1, T, rotary_dim]
        return self.rotation(rows.gather(0, index)[0], dtype)  # each column from its stream's row


def stream_of_frequency(mrope_section: Sequence[int], num_frequencies: int, interleaved: bool) -> torch.Tensor:
    """[num_frequencies] the stream each frequency follows: group i of `mrope_section` stream i % 3, or (interleaved,
    Qwen3-VL's) h and w on every third frequency from the second and the third, t on the rest."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(mrope_section)) % NUM_STREAMS, torch.tensor(mrope_section))
    streams = torch.zeros(num_frequencies, dtype=torch.int64)
    for stream in (1, 2):
        streams[stream : NUM_STREAMS * mrope_section[stream] : NUM_STREAMS] = stream
    return streams


def get_mrope(head_size: int, rotary_dim: int, max_position: int, base: float, mrope_section: Sequence[int],
              rope_scaling: Mapping[str, Any] | None = None, is_neox_style: bool = True,
              interleaved: bool = False) -> MRotaryEmbedding:
    """An MRotaryEmbedding over `get_rope`'s table for `rope_scaling` (None: plain frequencies, as Qwen2-VL's)."""
    cache = build_cos_sin_cache(rotary_dim, max_position, float(base), rope_scaling)
    return MRotaryEmbedding(head_size, rotary_dim, cache, mrope_section, is_neox_style, interleaved)


def mrope_input_positions(num_tokens: int, grids: Sequence[tuple[int, int, tuple[int, int, int]]]) -> tuple[
        np.ndarray, int]:
    """(positions [3, num_tokens] int64, delta) of a prompt whose `grids` are (offset, length, (t, h, w)) per image,
    in prompt order: the image's tokens are its t x h x w grid (of merged patches, row-major), the other tokens text."""
    positions = np.empty((NUM_STREAMS, num_tokens), dtype=np.int64)
    start = token = 0  # the next text position, and the next token
    for offset, length, (t, h, w) in grids:
        if offset < token or length != t * h * w:
            raise ValueError(f"an image at token {offset} of {length} tokens does not fit a {t}x{h}x{w} grid after "
                             f"the image before it (which ends at token {token})")
        positions[:, token:offset] = np.arange(offset - token) + start
        start += offset - token
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        positions[:, offset : offset + length] = np.stack([tt, hh, ww]).reshape(NUM_STREAMS, -1) + start
        start, token = start + max(t, h, w), offset + length
    positions[:, token:] = np.arange(num_tokens - token) + start
    delta = int(positions.max(initial=-1)) + 1 - num_tokens
    return positions, delta
