"""The encoder cache: each image's encoder output computed once, however its placeholders are chunked, and reused by
later requests with the same image (after vLLM's v1 EncoderCacheManager).

The scheduler owns the bookkeeping (`EncoderCacheManager`): which items are cached, which running requests still
need each (their placeholders not all computed yet), and which unneeded ones to evict, least recently used first,
when a new item needs room under `encoder_cache_size` placeholder tokens. The model runner holds the tensors
(`EncoderCache`): it computes an item when a step's chunk reaches placeholders it does not hold, and drops what the
scheduler evicted (`SchedulerOutput.free_encoder_identifiers`). The scheduler also spends a per-step encoder budget
(`max_num_encoder_input_tokens`) on the items it lets a step compute; a chunk stops before an item the budget or the
cache cannot take this step.

A deepstack model (Qwen3-VL: `deepstack_layers` > 0) returns wider rows, [tokens, (1 + layers) * hidden]: the
placeholders' input rows, then one row per deepstack layer, which the decoder adds to its stream after that layer
(`split_deepstack`: sliced with the chunk like the input rows, so a chunk boundary inside an image changes nothing).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from llmplug.layers.decoder.fast_path import LayerRows

if TYPE_CHECKING:
    from llmplug.engine.multimodal import MultiModalFeature
    from llmplug.engine.request import Request

__all__ = ["EncoderCache", "EncoderCacheManager", "split_deepstack"]


class EncoderCacheManager:
    """Which items the runner holds, who needs them, and what to evict (scheduler side; sizes in placeholder tokens)."""

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.cached: dict[str, int] = {}  # identifier -> its placeholder tokens
        self.users: dict[str, set[str]] = {}  # identifier -> requests whose placeholders still need it
        self.unused: OrderedDict[str, None] = OrderedDict()  # cached, needed by nobody: evictable, LRU first
        self.num_used_tokens = 0
        self.freed: list[str] = []  # evicted since the last take_freed(): the runner drops them
        # image items looked up when a request's chunk first reaches them, and those found (vllm:mm_cache_*)
        self.num_queries = 0
        self.num_hits = 0

    def has(self, identifier: str) -> bool:
        """True when the runner holds (or is about to compute) this item."""
        return identifier in self.cached

    def count_lookup(self, hit: bool) -> None:
        """Count one item looked up for a request (`hit`: its encoder output was held or being computed already)."""
        self.num_queries += 1
        self.num_hits += hit

    def can_allocate(self, feature: MultiModalFeature, num_pending: int = 0) -> bool:
        """Room for a new item once unused ones are evicted, beside `num_pending` tokens of items about to be
        allocated; an item larger than the cache fits when it is alone."""
        needed = self.num_used_tokens - sum(self.cached[i] for i in self.unused) + num_pending
        return needed == 0 or needed + feature.length <= self.cache_size

    def allocate(self, request: Request, feature: MultiModalFeature) -> None:
        """Make room (evicting unused items, LRU first) and record the item as needed by `request`."""
        while self.unused and self.num_used_tokens + feature.length > self.cache_size:
            victim, _ = self.unused.popitem(last=False)
            self.num_used_tokens -= self.cached.pop(victim)
            self.freed.append(victim)
        self.cached[feature.identifier] = feature.length
        self.num_used_tokens += feature.length
        self.use(request, feature)

    def use(self, request: Request, feature: MultiModalFeature) -> None:
        """`request` needs a cached item until its placeholders are computed."""
        self.unused.pop(feature.identifier, None)
        self.users.setdefault(feature.identifier, set()).add(request.request_id)

    def release(self, request: Request, computed_up_to: int | None = None) -> None:
        """`request` no longer needs its items whose placeholders end at or before `computed_up_to` (None: all of
        them: it finished or was preempted); an item nobody needs stays cached, evictable."""
        for feature in request.mm_features or ():
            if computed_up_to is not None and feature.end > computed_up_to:
                continue
            users = self.users.get(feature.identifier)
            if users is None or request.request_id not in users:
                continue
            users.discard(request.request_id)
            if not users:
                del self.users[feature.identifier]
                self.unused[feature.identifier] = None

    def reset(self) -> None:
        """Evict every item no request needs (new weights: the cached outputs are the old weights')."""
        while self.unused:
            victim, _ = self.unused.popitem(last=False)
            self.num_used_tokens -= self.cached.pop(victim)
            self.freed.append(victim)

    def take_freed(self) -> list[str]:
        """The items evicted since the last call (the runner drops their tensors)."""
        freed, self.freed = self.freed, []
        return freed


class EncoderCache:
    """The encoder outputs the model runner holds, by identifier: [num_embeds, hidden] each."""

    def __init__(self) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        self.num_encoder_calls = 0  # items computed so far (tests and stats)

    def drop(self, identifiers: list[str]) -> None:
        """Forget items the scheduler evicted."""
        for identifier in identifiers:
            self.outputs.pop(identifier, None)

    def ensure(self, model: Any, features: list[MultiModalFeature], device: torch.device, dtype: torch.dtype) -> None:
        """Compute, one item per call (so an item's rows never depend on what else a step holds), those not held."""
        for feature in features:
            if feature.identifier in self.outputs:
                continue
            data = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in feature.data.items()}
            (rows,) = model.embed_multimodal(**data)  # [length, hidden]
            if rows.shape[0] != feature.num_embeds:
                raise RuntimeError(f"{type(model).__name__}.embed_multimodal returned {rows.shape[0]} rows for an "
                                   f"{feature.modality} of {feature.num_embeds} placeholder tokens")
            self.outputs[feature.identifier] = rows
            self.num_encoder_calls += 1

    def step_rows(self, features: list[MultiModalFeature], start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """(offset from `start`, rows) of the encoder outputs that fill placeholders of tokens [start, end) — a
        chunk may start or end anywhere inside an item, and an item's placeholders may be several runs."""
        chunks = []
        for feature in features:
            for lo, hi, first_row in feature.embed_runs(start, end):
                chunks.append((lo - start, self.outputs[feature.identifier][first_row : first_row + hi - lo]))
        return chunks


def split_deepstack(chunks: list[tuple[int, torch.Tensor]], layers: int,
                    device: torch.device) -> tuple[list[tuple[int, torch.Tensor]], LayerRows]:
    """A step's (first row, encoder rows [n, (1 + layers) * hidden]) chunks of a deepstack model -> the chunks of
    the placeholders' input rows [n, hidden], and the deepstack rows the decoder adds after its first `layers`."""
    inputs, rows, values = [], [], []
    for row, wide in chunks:
        parts = wide.view(wide.shape[0], layers + 1, -1)
        inputs.append((row, parts[:, 0]))
        rows.append(torch.arange(row, row + wide.shape[0]))
        values.append(parts[:, 1:])
    return inputs, LayerRows(torch.cat(rows).to(device), torch.cat(values).transpose(0, 1))
