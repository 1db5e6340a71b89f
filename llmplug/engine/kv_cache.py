"""The paged KV cache: blocks, their reference counts, and prefix caching by chained block hashes.

A request's K/V live in fixed-size blocks (`block_size` tokens each) listed in its block table.
A block that is full is named by a hash of its tokens chained to the hash of the block before it,
so equal hashes mean equal prefixes. What the tokens alone do not say enters as the block's extra keys
(`block_extra_keys`): the LoRA adapter's id and load; for a prompt given as embeddings, the digest of its rows in
the block; for a multimodal prompt, the content hash of each image whose placeholders fall in the block — never
only placeholder tokens. A model with bidirectional spans (multimodal.bidirectional_spans) never gets a hit that ends
inside one, and a prompt block of one whose whole prompt is a span is named with the prompt's length; so is a block
holding generated tokens of a model that computes them with other kernels than prompts (int4 decode; the CPU
attention's AMX prompt tiles). Freed
blocks keep their hash and stay reusable until the pool needs them again; the least recently freed is
evicted first.

A model with recurrent mixers (Mamba, gated delta nets, short convs) also keeps a fixed-size state
per request: each running request owns one state slot (`StateSlotPool`) besides its blocks, taken
with its first blocks and released with them (finish, abort, preemption: a recomputed request starts
its state from zero). A state summarizes the whole prefix it has seen and cannot be shared or cut
back to a block boundary, so prefix caching is off for such models.

An encoder-decoder request (Whisper: `encoder_feature` set) holds a second list of blocks from the same pool, its
cross blocks (vLLM's cross-attention KV group): ceil(encoder tokens / block_size) of them, taken with its first
blocks and released with them, holding the cross-attention keys and values of its encoder states in every decoder
layer's cache tensor, with consecutive ids where the free blocks allow (read without a gather). A request is admitted
only when both lists fit. With prefix caching the cross blocks are named by the clip's content hash, so running or
later requests with the same clip share them (all of them or none).
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import numpy as np

from llmplug.core.errors import ConfigError
from llmplug.engine.multimodal import bidirectional_spans, block_keys as mm_block_keys, span_safe
from llmplug.engine.prompt_embeds import embeds_digest
from llmplug.engine.request import Request

logger = logging.getLogger(__name__)

def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple = ()) -> int:
    """The hash of one full block, chained to its parent's; stable across processes."""
    # blake2b rather than hash(): Python's str hashing is salted per process, and a 128-bit digest
    # makes a collision (which would silently reuse the wrong K/V) negligible.
    h = hashlib.blake2b(digest_size=16)
    # Fixed-width fields keep the byte layout unambiguous: no parent/tokens/extras mix can alias another.
    h.update(b"\x00" * 17 if parent_hash is None else b"\x01" + parent_hash.to_bytes(16, "little"))
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest(), "little")


def block_extra_keys(request: Request, block: int, block_size: int) -> tuple:
    """What names block `block` of the request beside its tokens: its adapter (K/V computed under an adapter are the
    adapter's; an id can name another adapter after a removal, a load is never reused), its prompt embeddings' rows
    and its images; an encoder-decoder request's every block, its audio (the decoder attends to it everywhere)."""
    start = block * block_size
    lora = () if request.lora_request is None else (request.lora_int_id, request.lora_load)
    images = mm_block_keys(request.mm_features, start, start + block_size)
    audio = () if request.encoder_feature is None else (("encoder", request.encoder_feature.identifier),)
    return lora + _embeds_key(request, block, block_size) + images + audio


def _embeds_key(request: Request, block: int, block_size: int) -> tuple:
    """The digest of the prompt embeddings in a block (empty past them): an embeddings prompt's blocks are named by
    its rows, never by its placeholder tokens, so they are shared only with prompts of the same embeddings."""
    embeds, start = request.prompt_embeds, block * block_size
    if embeds is None or start >= len(embeds):
        return ()
    return (embeds_digest(embeds, start, min(start + block_size, len(embeds))),)


def num_blocks_for_budget(
    memory_bytes: int,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    max_model_len: int | None = None,
) -> int:
    """How many KV blocks (K and V of every layer) fit in `memory_bytes`."""
    # k, v per layer: [num_blocks, block_size, num_kv_heads, head_dim]
    bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
    num_blocks = memory_bytes // bytes_per_block
    if max_model_len is not None:
        needed = -(-max_model_len // block_size)
        if num_blocks < needed:
            raise ConfigError(
                f"KV-cache budget of {memory_bytes} bytes holds {num_blocks} blocks of {bytes_per_block} bytes, "
                f"but one request of max_model_len={max_model_len} needs {needed} blocks "
                f"({needed * bytes_per_block} bytes); raise cache.kv_cache_memory / cache.memory_fraction "
                f"or lower model.max_model_len"
            )
    return num_blocks


@dataclass(slots=True)
class Block:
    """One KV block: how many requests use it and, once full and cached, its hash."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and how many were found."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits per queried token (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """All KV blocks: reference counts, the free list in LRU order, and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ConfigError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is free order: the first entry is the least recently freed, evicted first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not)."""
        return len(self.free_block_ids)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, evicting the least recently freed cached ones."""
        if num_blocks > len(self.free_block_ids):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self.free_block_ids)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def get_new_run(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` free blocks with consecutive ids (the lowest such run), evicting cached ones; None when
        the free blocks hold no such run."""
        if num_blocks > len(self.free_block_ids):
            return None
        free = np.fromiter(self.free_block_ids, dtype=np.int64, count=len(self.free_block_ids))
        free.sort()
        # sorted distinct ids: free[i:i + n] is a run exactly when its last id is its first plus n - 1
        starts = np.flatnonzero(free[num_blocks - 1 :] - free[: len(free) - num_blocks + 1] == num_blocks - 1)
        if not len(starts):
            return None
        first = int(free[starts[0]])
        block_ids = list(range(first, first + num_blocks))
        for block_id in block_ids:
            del self.free_block_ids[block_id]
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
        return block_ids

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self.cached_block_ids[block.block_hash]
            block.block_hash = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take another reference to cached blocks, pulling free ones off the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; unreferenced ones join the free list in this order."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None

    def get_cached_block(self, block_hash: int) -> int | None:
        """The block holding the K/V of the prefix named by `block_hash`, if still cached."""
        return self.cached_block_ids.get(block_hash)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full block under its hash so later requests can reuse it; False if it stays anonymous."""
        if not self.enable_prefix_caching:
            return False
        # An equal block already cached (computed twice, e.g. the last block of a fully-cached prompt)
        # keeps the name; this copy stays anonymous and is simply reused as a plain block once freed.
        if block_hash in self.cached_block_ids:
            return False
        self.blocks[block_id].block_hash = block_hash
        self.cached_block_ids[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Drop a block's hash: its K/V must never be reused (they may not have been written)."""
        self._evict(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block_id in self.cached_block_ids.values():
            self.blocks[block_id].block_hash = None
        self.cached_block_ids.clear()
        return True


class StateSlotPool:
    """Recurrent-state slots: the index of each running request's state in every recurrent layer's cache."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest index first

    @property
    def num_free_slots(self) -> int:
        """Slots no request holds."""
        return len(self.free_slots)

    def allocate(self) -> int:
        """Take a free slot."""
        if not self.free_slots:
            raise ValueError(f"all {self.num_slots} state slots are taken")
        return self.free_slots.pop()

    def free(self, slot: int) -> None:
        """Give a slot back."""
        self.free_slots.append(slot)


class KVCacheManager:
    """Block tables (and recurrent-state slots) of running requests, allocation as they grow, and
    prefix-cache lookups."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_state_slots: int = 0,
        bidirectional_spans: str | None = None, splits_generated_rows: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size={block_size} must be positive")
        if num_state_slots and enable_prefix_caching:
            logger.info("prefix caching is off: the model keeps recurrent state, which a cached prefix cannot restore")
            enable_prefix_caching = False
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.span_kind = bidirectional_spans  # the model's (multimodal.bidirectional_spans): no hit ends inside one
        # the model computes generated tokens with other kernels than prompts (int4 decode): see _generated_key
        self.splits_generated_rows = splits_generated_rows
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.state_pool = StateSlotPool(num_state_slots)
        self.state_slots: dict[str, int] = {}  # request id -> its state slot (models with recurrent mixers)
        self.block_tables: dict[str, list[int]] = {}  # request id -> block ids, in token order
        # encoder-decoder requests: request id -> its cross blocks (the encoder's K/V), and those found named in the
        # prefix cache (their K/V are written already: the workers do not run the encoder for them)
        self.cross_block_tables: dict[str, list[int]] = {}
        self._cross_hit_req_ids: set[str] = set()
        self.num_cached_blocks: dict[str, int] = {}  # request id -> leading blocks already hashed
        # request id -> leading blocks of its table the workers hold as they are (the rest is sent next step)
        self.num_sent_blocks: dict[str, int] = {}
        self._stats = PrefixCacheStats()
        # Requests whose lookup was counted but not yet allocated: a request that waits for blocks is
        # looked up every step, and counting each lookup would skew the hit rate towards it.
        self._counted_req_ids: set[str] = set()
        # Blocks named since the last finished step, by the request they were allocated to. They are named
        # when allocated (so a request of the same step can hit them), before their K/V are written; a step
        # that fails takes their names back, so no later prompt can hit a block holding garbage.
        self._named_this_step: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks in the cache."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """A snapshot of prefix-cache queries and hits, in tokens."""
        return replace(self._stats)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks of the request's longest cached prefix and the tokens they hold."""
        # prompt logprobs need the logits of every prompt position, so such a request computes them all
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        # At least one token is left to compute, so the model produces the logits to sample from.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hash_full_blocks(request, request.num_tokens // self.block_size)
        block_ids = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        if self.span_kind is not None:
            spans = bidirectional_spans(self.span_kind, request.mm_features, request.num_prompt_tokens)
            del block_ids[span_safe(spans, len(block_ids) * self.block_size, self.block_size) // self.block_size:]
        num_computed_tokens = len(block_ids) * self.block_size
        self._count_query(request, num_computed_tokens)
        return block_ids, num_computed_tokens

    def _count_query(self, request: Request, num_hit_tokens: int) -> None:
        if request.request_id not in self._counted_req_ids:
            self._counted_req_ids.add(request.request_id)
            self._stats.queries += request.num_tokens
            self._stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = (),
                       num_external_tokens: int = 0) -> bool:
        """Reserve blocks for the request's next `num_new_tokens`; False when too few are free.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks`, not yet counted in
        `request.num_computed_tokens`; `num_external_tokens` follow them, whose K/V a KV connector loads into new
        blocks (a multiple of block_size)."""
        block_table = self.block_tables.get(request.request_id, [])
        num_computed_tokens = (request.num_computed_tokens + len(new_computed_blocks) * self.block_size
                               + num_external_tokens)
        num_total_tokens = num_computed_tokens + num_new_tokens
        num_needed = -(-num_total_tokens // self.block_size) - len(block_table) - len(new_computed_blocks)
        cross_hits, num_cross = self._cross_needs(request)
        # Hits that sit on the free list stop being free once taken.
        num_free_hits = sum(1 for b in (*new_computed_blocks, *cross_hits) if self.pool.blocks[b].ref_count == 0)
        if max(num_needed, 0) + num_cross + num_free_hits > self.pool.num_free_blocks:
            return False
        if self._needs_state_slot(request):
            if not self.state_pool.num_free_slots:
                return False
            self.state_slots[request.request_id] = self.state_pool.allocate()
        self.pool.touch(new_computed_blocks)  # (before any new block is taken: that could evict a hit)
        if cross_hits or num_cross:
            self._allocate_cross(request, cross_hits, num_cross)
        block_table = self.block_tables.setdefault(request.request_id, block_table)
        block_table.extend(new_computed_blocks)
        if num_needed > 0:
            block_table.extend(self.pool.get_new_blocks(num_needed))
        self._counted_req_ids.discard(request.request_id)
        if self.enable_prefix_caching:
            self.num_cached_blocks.setdefault(request.request_id, len(new_computed_blocks))
            # The token sampled at the last position is not known yet: cache only blocks full of known tokens.
            self._cache_full_blocks(request, min(num_total_tokens, request.num_tokens) // self.block_size)
        return True

    def num_cross_blocks(self, request: Request) -> int:
        """The cross blocks an encoder-decoder request holds while it runs: its encoder states' (0 for any other)."""
        feature = request.encoder_feature
        return 0 if feature is None else -(-feature.length // self.block_size)

    def _cross_needs(self, request: Request) -> tuple[list[int], int]:
        """(named cross blocks to share, or new cross blocks to take) for a request that holds none yet."""
        if request.encoder_feature is None or request.request_id in self.cross_block_tables:
            return [], 0
        hits = [self.pool.get_cached_block(block_hash) for block_hash in self._cross_hashes(request)]
        if hits and None not in hits:  # all or none: the encoder writes a request's K/V whole
            return hits, 0
        return [], self.num_cross_blocks(request)

    def _cross_hashes(self, request: Request) -> list[int]:
        """The names of the request's cross blocks: its clip's content hash and the block's index (and its adapter,
        as for any block); none without prefix caching."""
        if self.enable_prefix_caching and not request.cross_block_hashes:
            lora = () if request.lora_request is None else (request.lora_int_id, request.lora_load)
            key = (*lora, ("cross", request.encoder_feature.identifier))
            request.cross_block_hashes = [hash_block(None, (i,), key) for i in range(self.num_cross_blocks(request))]
        return request.cross_block_hashes

    def _allocate_cross(self, request: Request, hits: list[int], num_new: int) -> None:
        """Give the request its cross blocks: the shared hits, or new blocks named (when allocated, like decoder
        blocks: a failed encoder or step takes the names back) for the requests that come with the same clip."""
        if hits:
            self.pool.touch(hits)
            self.cross_block_tables[request.request_id] = hits
            self._cross_hit_req_ids.add(request.request_id)
            return
        # consecutive ids if the free blocks hold a run: the workers then read them as a view of the cache, no gather
        block_ids = self.pool.get_new_run(num_new) or self.pool.get_new_blocks(num_new)
        self.cross_block_tables[request.request_id] = block_ids
        named = self._named_this_step.setdefault(request.request_id, [])
        for block_id, block_hash in zip(block_ids, self._cross_hashes(request)):
            if self.pool.cache_block(block_id, block_hash):
                named.append(block_id)

    def get_cross_blocks(self, request: Request) -> tuple[list[int], bool]:
        """A copy of the request's cross blocks, and whether their K/V are written already (a prefix-cache hit)."""
        req_id = request.request_id
        return list(self.cross_block_tables.get(req_id, ())), req_id in self._cross_hit_req_ids

    def _needs_state_slot(self, request: Request) -> bool:
        return self.state_pool.num_slots > 0 and request.request_id not in self.state_slots

    def _cache_full_blocks(self, request: Request, num_full_blocks: int) -> None:
        # Blocks are named when allocated, before this step writes their K/V: a request that hits
        # them in the same step reads them after the attention layer has written the whole batch.
        num_cached = self.num_cached_blocks[request.request_id]
        if num_full_blocks <= num_cached:
            return
        hashes = self._hash_full_blocks(request, num_full_blocks)
        block_table = self.block_tables[request.request_id]
        named = self._named_this_step.setdefault(request.request_id, [])
        for i in range(num_cached, num_full_blocks):
            if self.pool.cache_block(block_table[i], hashes[i]):
                named.append(block_table[i])
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def finish_step(self, failed_req_ids: Iterable[str] = ()) -> None:
        """The step ran: keep the names of the blocks it wrote, except those of requests that failed in it."""
        for req_id in failed_req_ids:
            self._unname(self._named_this_step.get(req_id, ()))
        self._named_this_step.clear()

    def abandon_step(self) -> None:
        """The step failed: take back every name given to blocks this step, whose K/V may be missing."""
        for block_ids in self._named_this_step.values():
            self._unname(block_ids)
        self._named_this_step.clear()

    def forget_blocks(self, block_ids: Iterable[int]) -> None:
        """Take back the names of blocks whose K/V turned out invalid (a failed KV connector load)."""
        self._unname(block_ids)

    def _unname(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self.pool.uncache_block(block_id)

    def _hash_full_blocks(self, request: Request, num_full_blocks: int) -> list[int]:
        """request.block_hashes extended to cover its first `num_full_blocks` blocks."""
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            extra = block_extra_keys(request, i, size) + self._prompt_span_key(request, i)
            extra += self._generated_key(request, i)
            parent = hash_block(parent, tuple(tokens[i * size : (i + 1) * size]), extra)
            hashes.append(parent)
        return hashes

    def _prompt_span_key(self, request: Request, block: int) -> tuple:
        """A model whose whole prompt attends both ways (bidirectional_spans "prompt"): a prompt block's K/V depend
        on every prompt token, so its name holds the prompt's length (the tokens up to the hit's end hold the rest)."""
        if self.span_kind != "prompt" or block * self.block_size >= request.num_prompt_tokens:
            return ()
        return (("prompt", request.num_prompt_tokens),)

    def _generated_key(self, request: Request, block: int) -> tuple:
        """A model whose generated tokens take other kernels than its prompts (int4 decode, prompts dense; the CPU
        attention's prompt tiles): the K/V of a block holding generated positions depend on where its request's prompt
        ended, so its name (and the names chained after it) holds the prompt's length; blocks wholly inside a prompt
        stay shared with any prompt."""
        if not self.splits_generated_rows or (block + 1) * self.block_size <= request.num_prompt_tokens:
            return ()
        return (("generated after", request.num_prompt_tokens),)

    def free(self, request: Request) -> None:
        """Release the request's blocks, cross blocks and state slot; cached blocks stay reusable until evicted."""
        slot = self.state_slots.pop(request.request_id, None)
        if slot is not None:
            self.state_pool.free(slot)
        block_table = self.block_tables.pop(request.request_id, [])
        # Tail first: its blocks are the least likely to be shared, so they are evicted first. Cross blocks last: a
        # miss on them costs an encoder run, a miss on a decoder block a few tokens.
        self.pool.free(reversed(block_table))
        self.pool.free(reversed(self.cross_block_tables.pop(request.request_id, [])))
        self._cross_hit_req_ids.discard(request.request_id)
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_sent_blocks.pop(request.request_id, None)
        self._counted_req_ids.discard(request.request_id)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` tokens (speculative decoding: blocks only
        rejected draft tokens were written to). They were never named: only blocks of known tokens are."""
        block_table = self.block_tables.get(request.request_id, [])
        keep = -(-num_tokens // self.block_size)
        if len(block_table) > keep:
            self.pool.free(reversed(block_table[keep:]))
            del block_table[keep:]
            if self.num_sent_blocks.get(request.request_id, 0) > keep:
                self.num_sent_blocks[request.request_id] = keep

    def get_block_ids(self, request: Request) -> list[int]:
        """A copy of the request's block table."""
        return list(self.block_tables.get(request.request_id, ()))

    def take_block_table_update(self, request: Request, whole: bool = False) -> tuple[int, list[int]]:
        """What the workers' copy of the request's block table lacks: how many of its leading blocks stay,
        and the blocks that follow them (all blocks when `whole`: the workers hold no table for it). From now
        on the workers are taken to hold the whole table."""
        block_table = self.block_tables.get(request.request_id, [])
        num_kept = 0 if whole else self.num_sent_blocks.get(request.request_id, 0)
        self.num_sent_blocks[request.request_id] = len(block_table)
        return num_kept, block_table[num_kept:]

    def get_state_slot(self, request: Request) -> int | None:
        """The request's recurrent-state slot (None for a model without recurrent mixers)."""
        return self.state_slots.get(request.request_id)

    @property
    def num_free_state_slots(self) -> int:
        """State slots no request holds."""
        return self.state_pool.num_free_slots

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; False (and nothing done) while any block is allocated."""
        return self.pool.reset_prefix_cache()
