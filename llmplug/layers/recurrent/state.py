"""Recurrent mixers and their state cache: fixed-size state per request, kept in slots.

A `RecurrentMixer` (Mamba, Mamba 2, gated delta net, short convolution) declares the shapes of its
per-request state (`state_shapes`: a conv window, an SSM or linear-attention state). The model
runner allocates each as one tensor [num_slots, *shape] per layer (`allocate_state_cache`) and binds
them (`bind_state_cache`); the KV-cache manager gives each running request one slot, the same index
in every layer. A step reads the state of its requests with one gather and writes it back with one
`index_copy_` over their slots.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from llmplug.layers.forward_context import get_forward_context
from llmplug.layers.recurrent.metadata import RecurrentMetadata

__all__ = [
    "RecurrentMixer",
    "StateShape",
    "allocate_state_cache",
    "bind_state_cache",
    "recurrent_layers",
    "state_bytes_per_slot",
]

StateCache = tuple[torch.Tensor, ...]  # one tensor [num_slots, *shape] per StateShape of the layer


@dataclass(frozen=True, slots=True)
class StateShape:
    """One per-request state tensor of a layer; dtype None: the model's dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    def dtype_for(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype of this state in a model of `model_dtype`."""
        return self.dtype or model_dtype


class RecurrentMixer(nn.Module, abc.ABC):
    """A token mixer with per-request state. Subclasses project, then mix single-token requests
    (`mix_steps`) and padded chunks (`mix_chunks`), reading and writing their state through the slots."""

    def __init__(self) -> None:
        super().__init__()
        self.state: StateCache | None = None  # bound by bind_state_cache

    @abc.abstractmethod
    def state_shapes(self) -> tuple[StateShape, ...]:
        """The per-request state tensors of this layer (on this tensor-parallel rank)."""

    @abc.abstractmethod
    def project_in(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, F]: every token's projected features, before any mixing across tokens."""

    @abc.abstractmethod
    def mix_steps(self, x: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        """x [S, F] (one token per request) -> [S, E], advancing the requests' states by one token."""

    @abc.abstractmethod
    def mix_chunks(
        self, x: torch.Tensor, lens: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor
    ) -> torch.Tensor:
        """x [P, L, F] (zero at padding, mask [P, L]) -> [P, L, E], advancing the states past each chunk."""

    @abc.abstractmethod
    def project_out(self, y: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, hidden]."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] for the step's requests (see RecurrentMetadata)."""
        meta = _metadata(self)
        x = self.project_in(hidden)
        steps = self.mix_steps(meta.gather_steps(x), meta.step_slots, meta.step_has_state) if meta.num_steps else None
        chunks = None
        if meta.num_chunks:
            chunks = self.mix_chunks(
                meta.gather_chunks(x), meta.chunk_lens, meta.chunk_mask, meta.chunk_slots, meta.chunk_has_state
            )
        return self.project_out(meta.scatter(steps, chunks))

    def read_state(self, index: int, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        """State `index` of the requests in `slots` ([R, *shape]); zero where `has_state` is False."""
        state = self.state[index][slots]
        keep = has_state.view(-1, *([1] * (state.dim() - 1)))
        return torch.where(keep, state, torch.zeros((), dtype=state.dtype, device=state.device))

    def write_state(self, index: int, slots: torch.Tensor, value: torch.Tensor) -> None:
        """Store state `index` of the requests in `slots` (in place, one op for the batch)."""
        cache = self.state[index]
        cache.index_copy_(0, slots, value.to(cache.dtype))


def _metadata(layer: RecurrentMixer) -> RecurrentMetadata:
    meta = get_forward_context().recurrent_metadata
    if meta is None or layer.state is None:
        raise RuntimeError(
            f"{type(layer).__name__} needs its state cache and the step's recurrent metadata: the model runner "
            "binds them (bind_state_cache) and passes forward_context(..., recurrent_metadata=...)"
        )
    return meta


def recurrent_layers(model: nn.Module) -> list[RecurrentMixer]:
    """The model's recurrent mixers in forward order (the order they were built in)."""
    return [m for m in model.modules() if isinstance(m, RecurrentMixer)]


def state_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes one request's state takes across all recurrent layers of `model` (0 without any)."""
    total = 0
    for layer in recurrent_layers(model):
        for spec in layer.state_shapes():
            itemsize = torch.empty((), dtype=spec.dtype_for(dtype)).element_size()
            total += itemsize * int(torch.Size(spec.shape).numel())
    return total


def allocate_state_cache(
    model: nn.Module, num_slots: int, dtype: torch.dtype, device: torch.device
) -> list[StateCache]:
    """Zeroed state tensors [num_slots, *shape] for every recurrent layer, in layer order."""
    return [
        tuple(torch.zeros((num_slots, *s.shape), dtype=s.dtype_for(dtype), device=device) for s in layer.state_shapes())
        for layer in recurrent_layers(model)
    ]


def bind_state_cache(model: nn.Module, caches: Sequence[StateCache] | None) -> int:
    """Give the i-th recurrent layer caches[i] (None: unbind); returns the layer count."""
    layers = recurrent_layers(model)
    if caches is not None and len(caches) != len(layers):
        raise ValueError(f"{len(caches)} state caches for {len(layers)} recurrent layers: allocate one per layer")
    for i, layer in enumerate(layers):
        layer.state = None if caches is None else caches[i]
    return len(layers)
