"""The KV connector protocol (`llmplug.kv_connectors` entry points): moving full KV blocks between the paged
cache and somewhere else — another memory tier, a disk, another engine.

A connector class is constructed twice, once per role, with the same `kv_transfer_config`:

- **scheduler** role, in the engine process. While admitting a waiting request the scheduler asks
  `get_num_new_matched_tokens` how many tokens past the local prefix-cache hit the connector holds; once it
  has allocated blocks for them it calls `update_state_after_alloc` with the (hash, block id) pairs to load.
  For every scheduled request it reports the full blocks the step computes (`request_computed_blocks`, the
  candidates to save). At the end of `schedule()`, `build_connector_meta()` packs what the workers must do into
  one picklable object, sent with the step. After the step, `update_connector_output` receives what went wrong
  (`KVConnectorOutput`, merged over the workers); `step_failed` when the step raised as a whole; `reset_cache`
  before new weights are loaded.
- **worker** role, in each worker process, beside the KV tensors. `register_kv_caches` hands it the paged
  tensors once they exist (again after a wake-up); `get_handshake_metadata` is gathered from every worker at
  start and given to the scheduler role's `set_handshake_metadata` (a disk tier lists its files there).
  Each step with metadata: `load_kv(meta)` before the forward pass writes the loaded blocks and returns the ids
  of blocks it could not load; `save_kv(meta, skip_req_ids)` after it copies out the blocks to save (slow work,
  a disk write, may continue in a background thread) and returns the hashes that are not stored: skipped, or
  failed since the last call.

A failed load is never a wrong answer: the scheduler discards what the step computed for every request that
read an invalid block and recomputes it. Block hashes are `engine.kv_cache.hash_block` values: 128-bit,
chained over token ids and extra keys, stable across processes and restarts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

    from llmplug.core.config.schema import KVTransferConfig

__all__ = ["KVCacheLayout", "KVConnector", "KVConnectorOutput", "KVConnectorRole", "KVLayerCache", "LoadBlock",
           "SaveBlock"]


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass(slots=True, frozen=True)
class KVCacheLayout:
    """What a connector knows of the KV cache it serves."""

    block_size: int  # tokens per block
    block_bytes: int  # one block across the worker's attention layers (K and V)
    # the identity of the bytes of a block: model, dtype, block size, layer shapes, attention backend, rank; blocks
    # of another fingerprint are never loaded ("" in the scheduler role, which holds no bytes)
    fingerprint: str = ""
    rank: int = 0  # the worker's rank (0 in the scheduler role)


@dataclass(slots=True, frozen=True)
class KVLayerCache:
    """One attention layer's paged cache tensor and the dimension that indexes its blocks."""

    tensor: torch.Tensor
    block_dim: int


@dataclass(slots=True, frozen=True)
class LoadBlock:
    """Write the K/V stored under `block_hash` into paged block `block_id` (for request `req_id`)."""

    req_id: str
    block_hash: int
    block_id: int


@dataclass(slots=True, frozen=True)
class SaveBlock:
    """Store paged block `block_id`, which request `req_id` computes this step, under `block_hash`."""

    req_id: str
    block_hash: int
    block_id: int


@dataclass(slots=True)
class KVConnectorOutput:
    """What the workers report of a step's transfers (a union over workers)."""

    invalid_block_ids: set[int] = field(default_factory=set)  # loads that failed: the blocks hold no valid K/V
    unsaved_hashes: set[int] = field(default_factory=set)  # saves skipped or failed: not stored

    def merge(self, other: KVConnectorOutput | None) -> None:
        """Add another worker's report."""
        if other is not None:
            self.invalid_block_ids |= other.invalid_block_ids
            self.unsaved_hashes |= other.unsaved_hashes


class KVConnector:
    """Base of `llmplug.kv_connectors` plugins; each method's default does nothing (holds nothing)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layout: KVCacheLayout) -> None:
        self.config = config
        self.role = role
        self.layout = layout

    # ---- scheduler role (engine process) ----
    def set_handshake_metadata(self, metadata: Sequence[Any]) -> None:
        """At start, each worker's `get_handshake_metadata()`, in rank order."""

    def get_num_new_matched_tokens(self, req_id: str, block_hashes: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (the local prefix-cache hit, a multiple of block_size) whose K/V the
        connector can load: a multiple of block_size. `block_hashes` are the request's full-block hashes the engine
        would reuse (the last prompt token is always computed). Called at every admission try, so keep it cheap."""
        return 0

    def update_state_after_alloc(self, req_id: str, loads: Sequence[tuple[int, int]]) -> None:
        """The (block hash, block id) pairs the request's admission allocated for the matched tokens: load them in
        this step (called only when the scheduler admitted the request with a match)."""

    def request_computed_blocks(self, req_id: str, blocks: Sequence[tuple[int, int]]) -> None:
        """The (block hash, block id) pairs of full blocks the request's chunk computes this step."""

    def build_connector_meta(self) -> Any:
        """What the workers do this step (picklable), or None for nothing; resets the step's state."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The step ran; what failed in its transfers."""

    def step_failed(self) -> None:
        """The step raised before its results came back: none of its saves happened."""

    def reset_cache(self) -> bool:
        """The model's weights are about to change (no request runs): never match a block stored before. False (the
        default) when the connector cannot, and the engine refuses the weight update."""
        return False

    # ---- worker role (each worker process) ----
    def register_kv_caches(self, caches: Sequence[KVLayerCache]) -> None:
        """The paged cache tensors, one per attention layer in model order."""

    def get_handshake_metadata(self) -> Any:
        """Picklable facts for the scheduler role (e.g. the blocks already stored), gathered once at start."""
        return None

    def load_kv(self, meta: Any) -> set[int]:
        """Before the forward pass: write the blocks to load; returns the block ids that could not be loaded
        (left untouched)."""
        return set()

    def save_kv(self, meta: Any, skip_req_ids: set[str]) -> set[int]:
        """After the forward pass: store the blocks to save except those of `skip_req_ids` (their step failed);
        returns the hashes not stored (skipped now, or failed in the background since the last call)."""
        return set()

    def shutdown(self) -> None:
        """Finish background work (pending writes) and release resources."""
