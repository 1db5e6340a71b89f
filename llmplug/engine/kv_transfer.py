"""The engine's side of KV connectors (`kv_transfer_config`, plugins of `llmplug.kv_connectors`): building one for
a role, describing a worker's paged cache to it, and finding what a failed load invalidates.

With no connector configured none of this runs: the scheduler and the model runner test one attribute for None.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Iterable, Sequence

from llmplug.core.errors import ConfigError
from llmplug.plugins.kv_connectors.base import KVCacheLayout, KVConnector, KVConnectorOutput, KVConnectorRole

if TYPE_CHECKING:
    import torch

    from llmplug.core.config import EngineConfig
    from llmplug.core.plugins import PluginRegistry
    from llmplug.engine.scheduler_output import ModelRunnerOutput, ScheduledRequest
    from llmplug.plugins.kv_connectors.base import KVLayerCache

__all__ = ["build_connector", "cache_fingerprint", "invalidated_blocks", "layer_caches", "merge_outputs"]


def build_connector(
    config: EngineConfig, registry: PluginRegistry, role: KVConnectorRole, layout: KVCacheLayout
) -> KVConnector | None:
    """The configured connector for `role`; None when kv_transfer_config.kv_connector is unset."""
    transfer = config.kv_transfer_config
    if transfer.kv_connector is None:
        return None
    if not config.cache.enable_prefix_caching:
        raise ConfigError(
            f"kv_transfer_config.kv_connector={transfer.kv_connector!r} needs cache.enable_prefix_caching: blocks "
            "are saved and found by their prefix-cache hashes; enable prefix caching or unset kv_connector"
        )
    connector_cls = registry.load("llmplug.kv_connectors", transfer.kv_connector)
    return connector_cls(transfer, role, layout)


def layer_caches(backend: type, layers: Sequence[torch.nn.Module], block_size: int) -> list[KVLayerCache]:
    """Each attention layer's cache tensor with its block dimension: the one in which the backend's shape for 2
    blocks differs from its shape for 1, whatever layout the backend chose."""
    from llmplug.plugins.kv_connectors.base import KVLayerCache

    caches = []
    for layer in layers:
        one, two = (backend.layer_kv_cache_shape(layer, n, block_size) for n in (1, 2))
        [block_dim] = [d for d, (a, b) in enumerate(zip(one, two)) if a != b]
        caches.append(KVLayerCache(layer.kv_cache, block_dim))
    return caches


def cache_fingerprint(config: EngineConfig, backend_name: str, layer_shapes: Iterable[tuple[int, ...]],
                      rank: int, world_size: int) -> str:
    """What the bytes of one block depend on, as canonical JSON: blocks of another fingerprint are never loaded."""
    model = config.model
    return json.dumps({
        "format": 1,
        "model": model.model, "revision": model.revision, "quantization": model.quantization, "dtype": model.dtype,
        "hf_overrides": model.hf_overrides, "block_size": config.cache.block_size, "attention_backend": backend_name,
        "layer_shapes": [list(shape) for shape in layer_shapes], "rank": rank, "world_size": world_size,
    }, sort_keys=True, default=str)


def merge_outputs(outputs: Sequence[ModelRunnerOutput], into: ModelRunnerOutput) -> None:
    """Make `into` report every worker's failed loads and unstored saves."""
    merged = KVConnectorOutput()
    for output in outputs:
        merged.merge(output.kv_connector_output)
    into.kv_connector_output = merged


def invalidated_blocks(
    scheduled: Sequence[ScheduledRequest], block_tables: dict[str, list[int]], block_size: int, invalid: set[int]
) -> tuple[set[str], set[int]]:
    """The requests of a step that read a block holding no valid K/V, and every such block: the `invalid` ones
    (failed loads) and those the step computed for such a request (they attended to invalid K/V). In schedule order,
    so a request that hit a block computed earlier in the same step by an invalidated request is invalidated too."""
    bad, requests = set(invalid), set()
    for s in scheduled:
        table = block_tables.get(s.req_id, ())
        num_read = math.ceil((s.num_computed_tokens + len(s.token_ids)) / block_size)
        if any(block_id in bad for block_id in table[:num_read]):
            requests.add(s.req_id)
            bad.update(table[s.num_computed_tokens // block_size : num_read])
    return requests, bad
