"""Attention: the `Attention` layer, the backend interface and `bind_kv_cache`.

Exports `Attention`, `AttentionBackend`, `bind_kv_cache`. Concrete backends (e.g.
`llmplug.layers.attention.torch_sdpa:TorchSDPABackend`) are reached through the `llmplug.attention`
entry-point group, not imported from here.
"""

from __future__ import annotations

from typing import Sequence

import torch

from llmplug.layers.attention.backend import AttentionBackend
from llmplug.layers.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "attention_layers", "bind_kv_cache"]


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    """The model's Attention layers in forward order (the order they were built in)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_cache(
    model: torch.nn.Module, caches: Sequence[torch.Tensor] | None, backend: type[AttentionBackend]
) -> int:
    """Give the i-th Attention layer caches[i] (None: run without a cache) and `backend`; returns the layer count.

    Drops whatever state a backend kept in the layers about their previous caches.
    """
    layers = attention_layers(model)
    if caches is not None and len(caches) != len(layers):
        raise ValueError(f"{len(caches)} KV caches for {len(layers)} Attention layers: allocate one per layer")
    for i, layer in enumerate(layers):
        layer.kv_cache = None if caches is None else caches[i]
        layer.backend = backend
        layer.backend_state = None
    return len(layers)
