"""Sleep mode: an idle engine gives its memory back (RL: while the trainer uses the device) and takes it again.

Levels follow vLLM:
- 1: the KV cache is freed and the weights move to host memory (on a CPU device they stay where they
  are); `wake_up` brings both back, and outputs are as before.
- 2: the KV cache and the weights are freed (each parameter keeps its shape, its storage shrinks to
  nothing), and so are the copies layers derived from them (int4, oneDNN-packed); `wake_up` allocates
  the weights again, and they hold no values until `update_weights` loads new ones.

What sleeps is named by tags, "weights" and "kv_cache", so an RL loop can wake the weights, load new
ones and only then allocate the KV cache. The K/V the prefix cache named are gone after a sleep, so
the engine resets it. Buffers (rotary tables) stay on the device: they are small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from llmplug.layers.quantization import DENSE

__all__ = [
    "SLEEP_LEVELS",
    "SLEEP_TAGS",
    "SleepingWeights",
    "check_sleep_level",
    "check_wake_tags",
    "sleep_weights",
    "wake_weights",
]

SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")


def check_sleep_level(level: int) -> int:
    """`level` if it is one of SLEEP_LEVELS; ValueError otherwise."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 (offload the weights) or 2 (discard them), got {level!r}")
    return level


def check_wake_tags(tags: Iterable[str] | None) -> frozenset[str]:
    """The tags to wake (None: all); ValueError naming an unknown one."""
    if tags is None:
        return frozenset(SLEEP_TAGS)
    tags = [tags] if isinstance(tags, str) else list(tags)
    unknown = sorted(set(tags) - set(SLEEP_TAGS))
    if unknown:
        raise ValueError(f"unknown wake_up tags {unknown}; the tags are {list(SLEEP_TAGS)}")
    return frozenset(tags)


@dataclass(frozen=True, slots=True)
class SleepingWeights:
    """What `wake_weights` needs: the level, and after level 2 each parameter's storage size in bytes."""

    level: int
    storage_bytes: dict[str, int] = field(default_factory=dict)


def sleep_weights(model: torch.nn.Module, level: int) -> SleepingWeights:
    """Level 1: move every parameter to host memory; level 2: free every parameter's storage (shapes stay)."""
    params = dict(model.named_parameters())  # a tied parameter is listed once; its users share the object
    if level == 1:
        for param in params.values():
            param.data = param.data.to("cpu")  # no copy when it is already there (a CPU device)
        return SleepingWeights(level)
    sizes = {name: param.untyped_storage().nbytes() for name, param in params.items()}  # before any is freed
    for param in params.values():
        param.untyped_storage().resize_(0)
    for module in model.modules():  # int4 / packed copies of the old weights: freed, and never used again
        if hasattr(module, "quant_method"):
            module.quant_method = DENSE
    return SleepingWeights(level, sizes)


def wake_weights(model: torch.nn.Module, sleeping: SleepingWeights, device: torch.device) -> None:
    """Bring every parameter back to `device`: its saved values, or (level 2) new uninitialized storage."""
    for name, param in model.named_parameters():
        if name in sleeping.storage_bytes:
            param.untyped_storage().resize_(sleeping.storage_bytes[name])
        param.data = param.data.to(device)
