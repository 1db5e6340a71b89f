"""A toy KV connector written against the public protocol only: every saved block stays on a shelf (a dict in the
worker), per layer. `kv_connector_extra_config={"lie": true}` makes it load zeros while reporting success, which
the conformance kit must catch."""

from __future__ import annotations

from llmplug.plugins.kv_connectors import KVConnector


class ShelfConnector(KVConnector):
    """Saves every computed full block; loads any block saved before."""

    def __init__(self, config, role, layout):
        super().__init__(config, role, layout)
        self.shelved: set[int] = set()  # scheduler role: hashes saved by finished steps
        self.loads, self.saves, self.in_flight = [], {}, []
        self.shelf: dict[int, list] = {}  # worker role: hash -> each layer's copy of the block
        self.caches = []

    # scheduler role
    def get_num_new_matched_tokens(self, req_id, block_hashes, num_computed_tokens):
        first = num_computed_tokens // self.layout.block_size
        matched = 0
        while first + matched < len(block_hashes) and block_hashes[first + matched] in self.shelved:
            matched += 1
        return matched * self.layout.block_size

    def update_state_after_alloc(self, req_id, loads):
        self.loads += loads

    def request_computed_blocks(self, req_id, blocks):
        for block_hash, block_id in blocks:
            if block_hash not in self.shelved:
                self.saves[block_hash] = (req_id, block_id)

    def build_connector_meta(self):
        meta = (self.loads, [(h, r, b) for h, (r, b) in self.saves.items()])
        self.in_flight = list(self.saves)
        self.shelved.update(self.saves)
        self.loads, self.saves = [], {}
        return meta

    def update_connector_output(self, output):
        self.shelved -= output.unsaved_hashes

    def step_failed(self):
        self.shelved.difference_update(self.in_flight)

    # worker role
    def register_kv_caches(self, caches):
        self.caches = list(caches)

    def load_kv(self, meta):
        loads, _ = meta
        invalid = set()
        for block_hash, block_id in loads:
            stored = self.shelf.get(block_hash)
            if stored is None:
                invalid.add(block_id)
                continue
            for cache, block in zip(self.caches, stored):
                target = cache.tensor.select(cache.block_dim, block_id)
                target.copy_(block * 0 if self.config.kv_connector_extra_config.get("lie") else block)
        return invalid

    def save_kv(self, meta, skip_req_ids):
        _, saves = meta
        for block_hash, req_id, block_id in saves:
            if req_id not in skip_req_ids:
                self.shelf[block_hash] = [c.tensor.select(c.block_dim, block_id).clone() for c in self.caches]
        return {block_hash for block_hash, req_id, _ in saves if req_id in skip_req_ids}
