"""New weights for a running engine (RL): cut into batches for the workers, loaded by the model's own loaders.

The engine process cuts the caller's (name, tensor) stream into batches of about `BATCH_BYTES`, so
neither side holds a second copy of the whole model at once. Every worker (every tensor-parallel
rank) receives every batch, and each layer's `weight_loader` keeps its own shard, exactly as when the
model was loaded. Names are checkpoint names (`model.layers.0.self_attn.q_proj.weight`), mapped by
the model's `load_weights` (its declarative name map), so unknown names and wrong shapes fail there
with the tensor's name.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from llmplug.core.errors import ModelLoadError

__all__ = ["BATCH_BYTES", "WeightBatch", "load_weight_batch", "weight_batches"]

BATCH_BYTES = 256 * 2**20  # one worker call: large enough to amortize the call, small next to a model

WeightBatch = list[tuple[str, torch.Tensor]]  # picklable: what collective_rpc carries to each worker


def weight_batches(weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int = BATCH_BYTES) -> Iterator[WeightBatch]:
    """Consecutive batches of the pairs, each closed once it holds `max_bytes` or more."""
    batch: WeightBatch = []
    size = 0
    for pair in weights:
        name, tensor = _checked_pair(pair)
        batch.append((name, tensor.detach()))  # a trainer's parameters: their autograd history stays home
        size += tensor.numel() * tensor.element_size()
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _checked_pair(pair: object) -> tuple[str, torch.Tensor]:
    """`pair` as (name, tensor); TypeError saying what it was instead."""
    if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], torch.Tensor):
        return pair
    shown = tuple(type(item).__name__ for item in pair) if isinstance(pair, (tuple, list)) else type(pair).__name__
    raise TypeError(
        f"update_weights takes (name: str, tensor: torch.Tensor) pairs, e.g. state_dict().items(); got {shown}"
    )


def load_weight_batch(model: torch.nn.Module, batch: WeightBatch) -> None:
    """Load one batch into `model` through its `load_weights` (the per-parameter weight loaders)."""
    try:
        model.load_weights(batch)
    except ModelLoadError as error:
        raise ModelLoadError(f"update_weights: {error}") from error
