"""llmplug.plugins.kv_connectors: the KV connector protocol (`KVConnector` and the data it passes) and the in-tree
`llmplug.kv_connectors` plugins, the offload tiers `cpu_offload` and `disk_offload` (see docs/kv_offload.md)."""

from llmplug.plugins.kv_connectors.base import (
    KVCacheLayout,
    KVConnector,
    KVConnectorOutput,
    KVConnectorRole,
    KVLayerCache,
    LoadBlock,
    SaveBlock,
)

__all__ = ["KVCacheLayout", "KVConnector", "KVConnectorOutput", "KVConnectorRole", "KVLayerCache", "LoadBlock",
           "SaveBlock"]
