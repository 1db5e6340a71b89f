"""The load balancer of data-parallel replicas: queue depth and prefix-cache affinity.

A request goes to the replica that last served the longest prefix of its prompt (whole KV blocks, hashed as a
chain like the prefix cache's block hashes), where those blocks are likely still cached, unless that replica
holds `max_imbalance` more requests than the least busy one; otherwise to the least busy replica (ties taken in
turn). A multi-turn conversation thus stays on one replica, whose cache holds its earlier turns, while a
shared system prompt alone does not pile every conversation onto one replica. `round_robin` and
`least_loaded` routing are there to compare against (benchmarks/serve.py --dp-routing).
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
    """Chooses a replica for each request (event-loop or engine thread only: not thread-safe)."""

    def __init__(self, num_replicas: int, routing: Routing = "prefix_affinity", max_imbalance: int = 8,
                 max_entries: int = 1 << 16):
        self.num_replicas = num_replicas
        self.routing = routing
        self.max_imbalance = max_imbalance
        self.max_entries = max_entries
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> replica that served it last (LRU)
        self._turn = itertools.count()
        self.affinity_lookups = 0  # requests whose prefix a replica had served
        self.affinity_hits = 0  # of those, the ones sent back to it

    def choose(self, keys: list[int], depths: Sequence[int], serving: Sequence[bool]) -> int:
        """The replica for a request with prefix `keys`, given each replica's queue depth and whether it serves."""
        candidates = [i for i in range(self.num_replicas) if serving[i]]
        if not candidates:
            raise ValueError("no replica is serving")
        if self.routing == "round_robin":
            return candidates[next(self._turn) % len(candidates)]
        least = min(depths[i] for i in candidates)
        owner = self._owner_of(keys) if self.routing == "prefix_affinity" else None
        if owner is not None:
            self.affinity_lookups += 1
            if serving[owner] and depths[owner] - least <= self.max_imbalance:
                self.affinity_hits += 1
                return owner
        idle = [i for i in candidates if depths[i] == least]
        return idle[next(self._turn) % len(idle)]

    def record(self, keys: list[int], replica: int) -> None:
        """`replica` now holds these prefix blocks (the last to serve a prefix owns it)."""
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget(self, replica: int) -> None:
        """`replica` lost its cache (it restarted): it owns no prefix any more."""
        self._owner = OrderedDict((k, r) for k, r in self._owner.items() if r != replica)

    def _owner_of(self, keys: list[int]) -> int | None:
        """The replica that served the longest of these prefixes, or None."""
        for key in reversed(keys):
            owner = self._owner.get(key)
            if owner is not None:
                return owner
        return None
