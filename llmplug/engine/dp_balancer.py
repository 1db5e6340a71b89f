"""The load balancer of data-parallel replicas: queue depth and prefix-cache affinity.

The balancer remembers which replicas served each prefix of whole KV blocks (hashed as a chain, like the prefix
cache's block hashes). A request goes to the replica that holds the longest prefix of its prompt, unless that
replica holds more than `max_imbalance` requests more than the least busy one; among replicas that hold equally
much (a system prompt every replica has served, or nothing) it goes to the least busy one (ties taken in turn).
A multi-turn conversation thus stays on the replica whose cache holds its earlier turns, while a prompt prefix
that every replica holds pulls no request anywhere. `round_robin` and `least_loaded` routing are there to compare
against (benchmarks/dp_affinity.py).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

__all__ = ["LoadBalancer", "Routing", "prefix_keys"]

Routing = Literal["prefix_affinity", "least_loaded", "round_robin"]

MAX_PREFIX_BLOCKS = 64  # the longest prefix looked up, in blocks: beyond it one conversation is surely placed
CHARS_PER_TOKEN = 4  # a text prompt without token ids is cut into blocks of block_size * 4 characters


def prefix_keys(tokens: Sequence[int] | str, block_size: int) -> list[int]:
    """One key per full block of the prompt's first MAX_PREFIX_BLOCKS blocks; key i covers blocks 0..i."""
    size = block_size * (CHARS_PER_TOKEN if isinstance(tokens, str) else 1)
    keys, key = [], 0
    for start in range(0, min(len(tokens) // size, MAX_PREFIX_BLOCKS) * size, size):
        key = hash((key, tuple(tokens[start:start + size])))
        keys.append(key)
    return keys


class LoadBalancer:
    """Chooses a replica for each request (engine thread only: not thread-safe)."""

    def __init__(self, num_replicas: int, routing: Routing = "prefix_affinity", max_imbalance: int = 8,
                 max_entries: int = 1 << 16):
        self.num_replicas = num_replicas
        self.routing = routing
        self.max_imbalance = max_imbalance
        self.max_entries = max_entries
        self._holders: OrderedDict[int, set[int]] = OrderedDict()  # prefix key -> replicas that served it (LRU)
        self._turn = itertools.count()
        self.affinity_lookups = 0  # requests of which some replica held more of the prompt than another
        self.affinity_hits = 0  # of those, the ones sent to a replica holding the most

    def choose(self, keys: list[int], depths: Sequence[int], serving: Sequence[bool]) -> int:
        """The replica for a request with prefix `keys`, given each replica's queue depth and whether it serves."""
        candidates = [i for i in range(self.num_replicas) if serving[i]]
        if not candidates:
            raise ValueError("no replica is serving")
        if self.routing == "round_robin":
            return candidates[next(self._turn) % len(candidates)]
        least = min(depths[i] for i in candidates)
        allowed = [i for i in candidates if depths[i] - least <= self.max_imbalance]
        held = self._held_blocks(keys) if self.routing == "prefix_affinity" else [0] * self.num_replicas
        most = max(held[i] for i in allowed)
        pool = [i for i in allowed if held[i] == most]
        pool_least = min(depths[i] for i in pool)
        idle = [i for i in pool if depths[i] == pool_least]
        chosen = idle[next(self._turn) % len(idle)]
        if max(held[i] for i in candidates) > min(held[i] for i in candidates):
            self.affinity_lookups += 1
            self.affinity_hits += held[chosen] == max(held[i] for i in candidates)
        return chosen

    def record(self, keys: list[int], replica: int) -> None:
        """`replica` now holds these prefix blocks."""
        for key in keys:
            self._holders.setdefault(key, set()).add(replica)
            self._holders.move_to_end(key)
        while len(self._holders) > self.max_entries:
            self._holders.popitem(last=False)

    def forget(self, replica: int) -> None:
        """`replica` lost its cache (it restarted): it holds no prefix any more."""
        for holders in self._holders.values():
            holders.discard(replica)

    def _held_blocks(self, keys: list[int]) -> list[int]:
        """How many of the prompt's leading blocks each replica holds (key i covers blocks 0..i)."""
        held = [0] * self.num_replicas
        for blocks, key in enumerate(keys, start=1):
            holders = self._holders.get(key)
            if not holders:
                break
            for replica in holders:
                held[replica] = blocks
        return held
