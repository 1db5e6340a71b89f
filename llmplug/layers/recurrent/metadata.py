"""Per-step metadata of the recurrent mixers: each request's state slot, whether its state carries
over, and how the flattened tokens split into single-token steps and padded multi-token chunks.

The model runner builds one `RecurrentMetadata` per step (`build_recurrent_metadata`, numpy then one
copy to the device) and passes it in the forward context next to the attention metadata; every
recurrent layer of the model reads the same one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["RecurrentMetadata", "build_recurrent_metadata"]


@dataclass(frozen=True, slots=True)
class RecurrentMetadata:
    """One step's requests as the recurrent mixers see them.

    "Steps" are requests with one token this step (decodes, and one-token prompts): their state is
    updated by one vectorized recurrence step. "Chunks" are the others (prompts and prompt chunks):
    their tokens are gathered into a zero-padded [num_chunks, max_chunk_len] batch and scanned.
    A request whose `has_state` is False starts from a zero state (its first chunk: a new request, or
    one recomputed after preemption); otherwise it continues from the state in its slot.
    """

    num_tokens: int  # T, the flattened step
    step_slots: torch.Tensor  # [S] int64 state slot of each single-token request
    step_tokens: torch.Tensor  # [S] int64 its token's index in T
    step_has_state: torch.Tensor  # [S] bool
    chunk_slots: torch.Tensor  # [P] int64
    chunk_tokens: torch.Tensor  # [P, L] int64 index in T of each chunk position (0 at padding)
    chunk_mask: torch.Tensor  # [P, L] bool, False at padding
    chunk_lens: torch.Tensor  # [P] int64
    chunk_has_state: torch.Tensor  # [P] bool
    num_steps: int
    num_chunks: int

    def gather_steps(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [S, ...] the single-token requests' rows."""
        return x[self.step_tokens]

    def gather_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [P, L, ...] the chunks' rows, zero at padding."""
        mask = self.chunk_mask.view(*self.chunk_mask.shape, *([1] * (x.dim() - 1)))
        return x[self.chunk_tokens].masked_fill(~mask, 0)

    def scatter(self, steps: torch.Tensor | None, chunks: torch.Tensor | None) -> torch.Tensor:
        """Per-request results back to the flattened order: [S, ...] and [P, L, ...] -> [T, ...]."""
        sample = steps if steps is not None else chunks[0, 0]
        trailing = sample.shape[1:] if steps is not None else sample.shape
        out = sample.new_empty(self.num_tokens, *trailing)
        if steps is not None:
            out[self.step_tokens] = steps
        if chunks is not None:
            out[self.chunk_tokens[self.chunk_mask]] = chunks[self.chunk_mask]
        return out


def build_recurrent_metadata(
    query_lens: np.ndarray, num_computed: np.ndarray, state_slots: np.ndarray, device: torch.device
) -> RecurrentMetadata:
    """From each request's tokens this step, tokens computed before it and state slot ([B] int64 each)."""
    starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int64)
    has_state = num_computed > 0
    is_step = query_lens == 1
    chunk = ~is_step
    lens = query_lens[chunk]
    width = int(lens.max()) if lens.size else 0
    offsets = np.arange(width, dtype=np.int64)
    mask = offsets[None, :] < lens[:, None]  # [P, L]
    tokens = np.where(mask, starts[chunk][:, None] + offsets[None, :], 0)
    arrays = dict(
        step_slots=state_slots[is_step],
        step_tokens=starts[is_step],
        step_has_state=has_state[is_step].astype(np.int64),
        chunk_slots=state_slots[chunk],
        chunk_tokens=tokens,
        chunk_mask=mask.astype(np.int64),
        chunk_lens=lens,
        chunk_has_state=has_state[chunk].astype(np.int64),
    )
    packed = torch.from_numpy(np.concatenate([a.ravel() for a in arrays.values()]).astype(np.int64))
    views = torch.split(packed.to(device, non_blocking=True), [a.size for a in arrays.values()])
    on_device = {name: view.view(a.shape) for (name, a), view in zip(arrays.items(), views)}
    for name in ("step_has_state", "chunk_mask", "chunk_has_state"):
        on_device[name] = on_device[name].bool()
    return RecurrentMetadata(
        num_tokens=int(query_lens.sum()), num_steps=int(is_step.sum()), num_chunks=int(chunk.sum()), **on_device
    )
