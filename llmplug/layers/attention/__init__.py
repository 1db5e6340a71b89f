"""Attention: the `Attention` layer, the backend interface and `bind_kv_cache`.

Exports `Attention`, `AttentionBackend`, `alibi_slopes`, `attention_layers`, `bind_kv_cache`.
Concrete backends (e.g. `llmplug.layers.attention.torch_sdpa:TorchSDPABackend`) are reached through
the `llmplug.attention` entry-point group, not imported from here.
"""

from __future__ import annotations

from typing import Sequence

import torch

from llmplug.layers.attention.backend import AttentionBackend
from llmplug.layers.attention.features import alibi_slopes
from llmplug.layers.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "alibi_slopes", "attention_layers", "bind_kv_cache"]


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    """The model's Attention layers in forward order (the order they were built in)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def bind_kv_cache(
    model: torch.nn.Module, caches: Sequence[torch.Tensor] | None, backend: type[AttentionBackend]
) -> int:
    """Give the i-th Attention layer caches[i] (None: run without a cache) and `backend`; returns the layer count.

    Drops whatever state a backend kept in the layers about their previous caches. A layer using a
    feature the backend does not implement is an error naming both.
    """
    layers = attention_layers(model)
    if caches is not None and len(caches) != len(layers):
        raise ValueError(f"{len(caches)} KV caches for {len(layers)} Attention layers: allocate one per layer")
    for layer in layers:
        _check_backend_supports(backend, layer)
    for i, layer in enumerate(layers):
        layer.kv_cache = None if caches is None else caches[i]
        layer.backend = backend
        layer.backend_state = None
    return len(layers)


def _check_backend_supports(backend: type[AttentionBackend], layer: Attention) -> None:
    """ValueError when `layer` uses a feature that `backend` does not list in `supported_features`."""
    missing = layer.features - backend.supported_features
    if missing:
        raise ValueError(
            f"attention backend {backend.name or backend.__name__!r} does not implement {sorted(missing)}, "
            f"which Attention layer {layer.layer_name!r} uses; choose a backend that does "
            "(device.attention_backend, e.g. 'torch_sdpa')"
        )
