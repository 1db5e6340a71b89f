"""How much device memory the KV cache gets on a platform that profiles (GPUs).

After the weights are loaded, the worker runs one dummy step at the engine's limits (the whole token
budget, split over max_num_seqs requests) and reads the device's peak allocation. The cache then
gets `memory_fraction` of the device, less what is in use after the profile (weights, the driver's
context, other processes) and less that activation peak, which every later step may need again.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemoryProfile", "kv_cache_bytes"]


@dataclass(slots=True, frozen=True)
class MemoryProfile:
    """Device memory measured around the dummy step, in bytes."""

    total: int  # the device's memory
    in_use: int  # in use after the step once the allocator's cache is released (weights, context, others)
    peak_activations: int  # the step's peak allocation above what was allocated before it


def kv_cache_bytes(profile: MemoryProfile, memory_fraction: float) -> int:
    """KV-cache bytes: memory_fraction of the device less what is in use and the activation peak (at least 0)."""
    return max(0, int(profile.total * memory_fraction) - profile.in_use - profile.peak_activations)
