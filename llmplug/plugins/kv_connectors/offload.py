"""The in-tree offload tiers (`cpu_offload`, `disk_offload`): every full block the engine computes is written
through to a tier, so a prefix evicted from the paged cache (or computed before a restart, on disk) is loaded back
instead of recomputed.

The scheduler role owns the tier's index: which hashes are stored, in LRU order, within the tier's capacity in
blocks. It alone decides what is saved, loaded and evicted, and sends it to the workers as an `OffloadMeta`; each
worker's store (stores.py) follows. A block saved in a step is indexed at the end of that step's scheduling, so it
is never matched before it exists; a save the workers report as not stored, or a step that failed, takes it out.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from llmplug.core.errors import ConfigError
from llmplug.plugins.kv_connectors.stores import block_file_name
from llmplug.plugins.kv_connectors.base import (
    KVCacheLayout,
    KVConnector,
    KVConnectorOutput,
    KVConnectorRole,
    KVLayerCache,
    LoadBlock,
    SaveBlock,
)

logger = logging.getLogger(__name__)

__all__ = ["BlockIndex", "CPUOffloadConnector", "DiskOffloadConnector", "OffloadConnector", "OffloadMeta",
           "OffloadStats"]

GIB = 2**30


@dataclass(slots=True, frozen=True)
class OffloadMeta:
    """One step's work for the workers: loads before the forward pass; evictions, then saves, after it."""

    loads: list[LoadBlock]
    saves: list[SaveBlock]
    evictions: list[int]  # hashes to drop


@dataclass(slots=True)
class OffloadStats:
    """Counts of the tier's blocks since start (scheduler role)."""

    matched_blocks: int = 0  # found for admitted requests past their local prefix-cache hit
    loaded_blocks: int = 0  # of those, loaded
    failed_loads: int = 0  # of those, not loaded (the requests recomputed them)
    saved_blocks: int = 0
    unsaved_blocks: int = 0  # saves skipped or failed
    evicted_blocks: int = 0


class BlockIndex:
    """Stored block hashes in LRU order (the first is evicted first), at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hashes

    def __len__(self) -> int:
        return len(self._hashes)

    def __iter__(self) -> Iterator[int]:
        return iter(self._hashes)

    def num_matched(self, block_hashes: Sequence[int]) -> int:
        """How many leading `block_hashes` are stored."""
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self._hashes:
                return i
        return len(block_hashes)

    def touch(self, block_hash: int) -> None:
        """Mark a hash as just used."""
        self._hashes.move_to_end(block_hash)

    def add(self, block_hash: int) -> list[int]:
        """Store a hash (most recently used); returns the hashes evicted to make room."""
        evicted = []
        while len(self._hashes) >= self.capacity and self._hashes:
            evicted.append(self._hashes.popitem(last=False)[0])
        if self.capacity > 0:
            self._hashes[block_hash] = None
        return evicted

    def remove(self, block_hash: int) -> None:
        """Forget a hash (not stored after all)."""
        self._hashes.pop(block_hash, None)


class OffloadConnector(KVConnector):
    """Write-through offload of full blocks to one tier; subclasses say which tier and its capacity."""

    def __init__(self, config: Any, role: KVConnectorRole, layout: KVCacheLayout) -> None:
        super().__init__(config, role, layout)
        self.loads_enabled = config.kv_role != "kv_producer"
        self.saves_enabled = config.kv_role != "kv_consumer"
        if role is KVConnectorRole.SCHEDULER:
            self.index = BlockIndex(self.capacity_bytes() // max(layout.block_bytes, 1))
            self.stats = OffloadStats()
            self._loads: list[LoadBlock] = []
            self._saves: dict[int, SaveBlock] = {}  # this step's, by hash: one save per hash
            self._evictions: list[int] = []
            self._in_flight: list[int] = []  # hashes indexed for the step that runs now
            self._step_loads: dict[int, int] = {}  # block id -> hash loaded into it by the step that runs now
        else:
            self.store = self.open_store()
            self.caches: list[KVLayerCache] = []

    # ---- what a tier says ----
    def capacity_bytes(self) -> int:
        """The tier's size in bytes."""
        raise NotImplementedError

    def open_store(self) -> Any:
        """The worker's store (stores.py) for this tier."""
        raise NotImplementedError

    # ---- scheduler role ----
    def set_handshake_metadata(self, metadata: Sequence[Any]) -> None:
        """Index the blocks every worker already holds (a disk tier after a restart), oldest first."""
        listings = [dict(listing or ()) for listing in metadata]
        if not listings:
            return
        common = set(listings[0]).intersection(*listings[1:])
        for block_hash in sorted(common, key=lambda h: min(listing[h] for listing in listings)):
            self._evictions += self.index.add(block_hash)
        self._evictions += [h for listing in listings for h in listing if h not in common]
        if common:
            logger.info("KV offload tier: %d blocks stored before start are indexed", len(self.index))

    def get_num_new_matched_tokens(self, req_id: str, block_hashes: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens of the stored blocks that follow the local hit."""
        if not self.loads_enabled:
            return 0
        first = num_computed_tokens // self.layout.block_size
        return self.index.num_matched(block_hashes[first:]) * self.layout.block_size

    def update_state_after_alloc(self, req_id: str, loads: Sequence[tuple[int, int]]) -> None:
        """Load the matched blocks this step."""
        for block_hash, block_id in loads:
            self.index.touch(block_hash)
            self._loads.append(LoadBlock(req_id, block_hash, block_id))
        self.stats.matched_blocks += len(loads)

    def request_computed_blocks(self, req_id: str, blocks: Sequence[tuple[int, int]]) -> None:
        """Save the blocks not stored yet."""
        if not self.saves_enabled:
            return
        for block_hash, block_id in blocks:
            if block_hash in self.index:
                self.index.touch(block_hash)
            elif block_hash not in self._saves:
                self._saves[block_hash] = SaveBlock(req_id, block_hash, block_id)

    def build_connector_meta(self) -> OffloadMeta | None:
        """This step's loads, evictions and saves; the saved hashes are indexed from now on."""
        for block_hash in self._saves:
            self._evictions += self.index.add(block_hash)
        if self.config.kv_role == "kv_consumer":  # it reads what others wrote: it never deletes
            self._evictions = []
        meta = None
        if self._loads or self._saves or self._evictions:
            meta = OffloadMeta(self._loads, list(self._saves.values()), self._evictions)
            self.stats.evicted_blocks += len(self._evictions)
        self._in_flight = list(self._saves)
        self._step_loads = {load.block_id: load.block_hash for load in self._loads}
        self._loads, self._saves, self._evictions = [], {}, []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Count the step's loads and saves; forget the hashes the workers did not store, and evict those whose
        load failed (a missing or corrupt copy is never matched again)."""
        failed = [h for block_id, h in self._step_loads.items() if block_id in output.invalid_block_ids]
        self.stats.failed_loads += len(failed)
        self.stats.loaded_blocks += len(self._step_loads) - len(failed)
        for block_hash in failed:
            self.index.remove(block_hash)
            self._evictions.append(block_hash)
        for block_hash in output.unsaved_hashes:
            self.index.remove(block_hash)
        unsaved = len(output.unsaved_hashes)
        self.stats.unsaved_blocks += unsaved
        self.stats.saved_blocks += len(self._in_flight) - len(output.unsaved_hashes.intersection(self._in_flight))
        self._in_flight, self._step_loads = [], {}

    def step_failed(self) -> None:
        """None of the step's saves happened."""
        for block_hash in self._in_flight:
            self.index.remove(block_hash)
        self._in_flight, self._step_loads = [], {}

    def reset_cache(self) -> bool:
        """Evict every stored block: they were computed with the weights about to change."""
        self._evictions += list(self.index)
        self.index = BlockIndex(self.index.capacity)
        return True

    # ---- worker role ----
    def register_kv_caches(self, caches: Sequence[KVLayerCache]) -> None:
        """Keep the paged tensors to copy blocks from and to."""
        from llmplug.plugins.kv_connectors.block_io import row_bytes

        self.caches = list(caches)
        self.row_bytes = row_bytes(self.caches)

    def get_handshake_metadata(self) -> list[tuple[int, float]]:
        """(hash, last use) of the blocks the store holds already."""
        return self.store.listing()

    def load_kv(self, meta: OffloadMeta) -> set[int]:
        """Write the stored rows into their blocks; the blocks whose row is missing or malformed are invalid."""
        from llmplug.plugins.kv_connectors.block_io import write_blocks

        block_ids, rows, invalid = [], [], set()
        for load in meta.loads:
            row = self.store.get(load.block_hash)
            if row is None or row.numel() != self.row_bytes:
                invalid.add(load.block_id)
            else:
                block_ids.append(load.block_id)
                rows.append(row)
        write_blocks(self.caches, block_ids, rows)
        return invalid

    def save_kv(self, meta: OffloadMeta, skip_req_ids: set[str]) -> set[int]:
        """Evict, then store the computed blocks of the requests whose step went well."""
        from llmplug.plugins.kv_connectors.block_io import read_blocks

        for block_hash in meta.evictions:
            self.store.delete(block_hash)
        saves = [save for save in meta.saves if save.req_id not in skip_req_ids]
        for save, row in zip(saves, read_blocks(self.caches, [save.block_id for save in saves])):
            self.store.put(save.block_hash, row)
        skipped = {save.block_hash for save in meta.saves if save.req_id in skip_req_ids}
        return skipped | self.store.take_failed()

    def shutdown(self) -> None:
        """Finish the store's pending work."""
        self.store.close()


class CPUOffloadConnector(OffloadConnector):
    """`cpu_offload`: blocks in host memory, LRU within kv_transfer_config.kv_offloading_size GiB per worker."""

    def capacity_bytes(self) -> int:
        """kv_offloading_size in bytes."""
        return int(self.config.kv_offloading_size * GIB)

    def open_store(self) -> Any:
        """Rows in a dict."""
        from llmplug.plugins.kv_connectors.stores import CPUBlockStore

        return CPUBlockStore()


class DiskOffloadConnector(OffloadConnector):
    """`disk_offload`: blocks as files under kv_transfer_config.kv_offloading_path, one directory per fingerprint,
    LRU within kv_offloading_disk_size GiB per worker; they outlive the engine, and engines sharing the directory
    share them. With kv_role kv_producer (a prefill engine) a block is written before its step returns; a kv_consumer
    (a decode engine) finds the blocks written after it started, and never writes or deletes one."""

    def __init__(self, config: Any, role: KVConnectorRole, layout: KVCacheLayout) -> None:
        if not config.kv_offloading_path:
            raise ConfigError(
                "kv_transfer_config.kv_connector='disk_offload' needs kv_transfer_config.kv_offloading_path "
                "(--kv-offloading-path): the directory the blocks are written to"
            )
        super().__init__(config, role, layout)
        self.directories: list[Path] = []  # scheduler role: each worker's, from the handshake

    def capacity_bytes(self) -> int:
        """kv_offloading_disk_size in bytes."""
        return int(self.config.kv_offloading_disk_size * GIB)

    def set_handshake_metadata(self, metadata: Sequence[Any]) -> None:
        """Each worker's directory, and the blocks in it."""
        self.directories = [Path(m["directory"]) for m in metadata]
        super().set_handshake_metadata([m["blocks"] for m in metadata])

    def get_num_new_matched_tokens(self, req_id: str, block_hashes: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens of the indexed blocks that follow the local hit, and of the blocks after them that another engine
        (a prefill engine, a replica) has written to every worker's directory since: those are indexed now."""
        num_tokens = super().get_num_new_matched_tokens(req_id, block_hashes, num_computed_tokens)
        if not self.loads_enabled:
            return num_tokens
        first = (num_computed_tokens + num_tokens) // self.layout.block_size
        for block_hash in block_hashes[first:]:
            name = block_file_name(block_hash)
            if not all((directory / name).exists() for directory in self.directories):
                break
            self._evictions += self.index.add(block_hash)
            num_tokens += self.layout.block_size
        return num_tokens

    def get_handshake_metadata(self) -> dict[str, Any]:
        """The worker's directory and (hash, mtime) of the block files in it."""
        return {"directory": str(self.store.directory), "blocks": self.store.listing()}

    def reset_cache(self) -> bool:
        """Evict every stored block, and save and load no more: blocks of the new weights would be filed under the
        checkpoint's fingerprint, and a restart on the checkpoint would load them."""
        logger.warning("disk_offload is off from now on: the weights changed, and its blocks outlive the engine")
        self.loads_enabled = self.saves_enabled = False
        return super().reset_cache()

    def open_store(self) -> Any:
        """The fingerprint's directory under kv_offloading_path."""
        import hashlib

        from llmplug.plugins.kv_connectors.stores import DiskBlockStore

        digest = hashlib.sha256(self.layout.fingerprint.encode()).hexdigest()[:24]
        synchronous = self.config.kv_role == "kv_producer"  # its blocks are on disk when its request returns
        return DiskBlockStore.open(self.config.kv_offloading_path, digest, self.layout.fingerprint, synchronous)
