"""KV-cache manager: block accounting, chained block hashes, prefix hits, LRU eviction."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmplug.core.errors import ConfigError
from llmplug.core.params import SamplingParams
from llmplug.engine.kv_cache import KVCacheManager, hash_block, num_blocks_for_budget
from llmplug.engine.request import Request

BS = 4  # block size of every test here


def req(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, list(tokens), SamplingParams())


def prefill(kv: KVCacheManager, request: Request) -> list[int]:
    """Look up the prefix cache and allocate the rest of the prompt, as the scheduler does."""
    blocks, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, blocks)
    request.num_computed_tokens = request.num_tokens
    return blocks


def test_hash_block_chains_parent_and_extra_keys():
    tokens = (1, 2, 3, 4)
    root = hash_block(None, tokens)
    assert root == hash_block(None, tokens)
    assert hash_block(root, tokens) != hash_block(hash_block(None, (9, 9, 9, 9)), tokens)
    assert hash_block(root, tokens) != root
    assert hash_block(None, tokens, ("lora-a",)) != root
    assert hash_block(None, (1, 2, 3)) != hash_block(None, (1, 2, 3, 0))


def test_hash_block_is_stable_across_processes():
    code = "from llmplug.engine.kv_cache import hash_block; print(hash_block(hash_block(None, (1, 2)), (3,), ('x',)))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert int(out.stdout) == hash_block(hash_block(None, (1, 2)), (3,), ("x",))


def test_allocate_and_free_return_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(10)))
    prefill(kv, a)
    assert len(kv.get_block_ids(a)) == 3 and kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)
    for token in (10, 11, 12):  # decode: a block is added only when the last one is full
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert len(kv.get_block_ids(a)) == 4
    kv.free(a)
    assert kv.num_free_blocks == kv.num_blocks and kv.get_block_ids(a) == []


def test_allocate_fails_without_side_effects_when_blocks_run_out():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    big = req("big", list(range(13)))
    assert not kv.allocate_slots(big, 13)
    assert kv.num_free_blocks == 3 and kv.get_block_ids(big) == []
    assert kv.allocate_slots(big, 12)
    kv.free(big)
    assert kv.num_free_blocks == 3


def test_second_request_reuses_cached_prefix_and_counts_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(10)))
    prefill(kv, a)
    b = req("b", list(range(8)) + [99, 98, 97])
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8 and blocks == kv.get_block_ids(a)[:2]
    assert kv.allocate_slots(b, b.num_tokens - num_cached, blocks)
    assert kv.get_block_ids(b)[:2] == blocks and kv.num_free_blocks == 10 - 3 - 1
    stats = kv.prefix_cache_stats
    assert (stats.queries, stats.hits) == (10 + 11, 8)
    assert stats.hit_rate == pytest.approx(8 / 21)
    kv.free(a)  # b still holds the shared blocks
    assert kv.num_free_blocks == 10 - 3
    kv.free(b)
    assert kv.num_free_blocks == 10


def test_waiting_request_lookup_is_counted_once():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(8)))
    kv.get_computed_blocks(a)
    kv.get_computed_blocks(a)  # looked up again next step: it could not be allocated
    assert kv.prefix_cache_stats.queries == 8


def test_whole_prompt_is_never_a_hit():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prefill(kv, req("a", list(range(8))))
    blocks, num_cached = kv.get_computed_blocks(req("b", list(range(8))))
    assert num_cached == 4 and len(blocks) == 1  # the last token is computed to get logits


def test_prefix_caching_disabled_finds_nothing():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    a = req("a", list(range(8)))
    prefill(kv, a)
    assert kv.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    assert kv.prefix_cache_stats.queries == 0
    kv.free(a)
    assert kv.num_free_blocks == 10


def test_decode_caches_a_block_once_its_last_token_is_known():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", [5, 6, 7])
    prefill(kv, a)
    assert kv.pool.cached_block_ids == {}  # block 0 holds 3 tokens: not full
    a.append_output_token(8)  # sampled at position 2; its K/V is computed by the next step
    assert kv.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert len(kv.pool.cached_block_ids) == 1 and a.block_hashes == [hash_block(None, (5, 6, 7, 8))]
    hit, num_cached = kv.get_computed_blocks(req("b", [5, 6, 7, 8, 1]))
    assert num_cached == 4 and hit == kv.get_block_ids(a)[:1]


def test_free_cached_blocks_are_evicted_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a, b = req("a", [1, 1, 1, 1, 1]), req("b", [2, 2, 2, 2, 2])
    prefill(kv, a)
    prefill(kv, b)
    kv.free(a)  # free order: a's tail, a's head, then b's tail, b's head
    kv.free(b)
    assert kv.num_free_blocks == 4
    assert kv.get_computed_blocks(req("a2", [1, 1, 1, 1, 0]))[1] == 4  # still cached after free
    prefill(kv, req("c", [3]))  # takes a's uncached tail
    assert kv.get_computed_blocks(req("a3", [1, 1, 1, 1, 0]))[1] == 4
    prefill(kv, req("d", [4]))  # evicts a's head, the least recently freed cached block
    assert kv.get_computed_blocks(req("a4", [1, 1, 1, 1, 0]))[1] == 0
    assert kv.get_computed_blocks(req("b2", [2, 2, 2, 2, 0]))[1] == 4


def test_touching_a_free_cached_block_takes_it_off_the_free_list():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = req("a", [1, 1, 1, 1, 1])
    prefill(kv, a)
    kv.free(a)
    b = req("b", [1, 1, 1, 1, 2, 2, 2, 2, 2])  # one hit (free) + two new blocks = all three
    blocks, num_cached = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens - num_cached, blocks)
    assert kv.num_free_blocks == 0 and len(set(kv.get_block_ids(b))) == 3
    c = req("c", [1, 1, 1, 1, 9])
    blocks, num_cached = kv.get_computed_blocks(c)
    assert not kv.allocate_slots(c, 1, blocks)  # the hit is shared, but c's second block is not free
    kv.free(b)
    assert kv.num_free_blocks == 3


def test_reset_prefix_cache_only_when_nothing_is_allocated():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(5)))
    prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(req("b", list(range(6))))[1] == 0


def test_num_blocks_for_budget_counts_k_and_v_of_every_layer():
    bytes_per_block = 2 * 16 * 2 * 4 * 8 * 2  # K and V, block_size 16, 2 layers, 4 heads, dim 8, fp16
    assert num_blocks_for_budget(10 * bytes_per_block + 1, 16, 2, 4, 8, 2) == 10
    assert num_blocks_for_budget(10 * bytes_per_block, 16, 2, 4, 8, 2, max_model_len=160) == 10


def test_num_blocks_for_budget_rejects_a_budget_below_one_max_length_request():
    with pytest.raises(ConfigError, match=r"max_model_len=161 needs 11 blocks"):
        num_blocks_for_budget(10 * 2048, 16, 2, 4, 8, 2, max_model_len=161)


def test_a_request_takes_one_state_slot_with_its_blocks_and_frees_it_with_them():
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_state_slots=2)
    assert not kv.enable_prefix_caching  # off for models with recurrent state
    a, b, c = req("a", [1] * 5), req("b", [2] * 3), req("c", [3] * 2)
    assert kv.allocate_slots(a, 5) and kv.allocate_slots(b, 3)
    assert {kv.get_state_slot(a), kv.get_state_slot(b)} == {0, 1} and kv.num_free_state_slots == 0
    free_blocks = kv.num_free_blocks
    assert not kv.allocate_slots(c, 2)  # no slot left: nothing taken
    assert kv.num_free_blocks == free_blocks and kv.get_state_slot(c) is None
    slot = kv.get_state_slot(a)
    assert kv.allocate_slots(a, 4)  # a growing request keeps its slot
    assert kv.get_state_slot(a) == slot
    kv.free(a)
    assert kv.num_free_state_slots == 1 and kv.allocate_slots(c, 2) and kv.get_state_slot(c) == slot
    kv.free(b), kv.free(c)
    assert kv.num_free_state_slots == 2 and kv.num_free_blocks == kv.num_blocks


def test_a_request_without_blocks_takes_no_state_slot():
    kv = KVCacheManager(num_blocks=1, block_size=BS, num_state_slots=1)
    assert not kv.allocate_slots(req("a", [1] * 9), 9)
    assert kv.num_free_state_slots == 1


def test_a_failed_step_takes_back_the_names_it_gave():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    done = req("done", list(range(8)))
    prefill(kv, done)
    kv.finish_step()  # the step that wrote done's two blocks ran
    failing = req("failing", list(range(8)) + [50, 51, 52, 53, 54])
    assert prefill(kv, failing)  # hits done's two blocks, names its third
    assert len(kv.pool.cached_block_ids) == 3
    kv.abandon_step()
    kv.free(failing)
    # done's names stay (their K/V were written); the failed step's block has no name left
    assert sorted(kv.pool.cached_block_ids) == sorted(done.block_hashes)
    again = req("again", list(range(8)) + [50, 51, 52, 53, 54])
    assert kv.get_computed_blocks(again)[1] == 8


def test_a_request_failing_alone_loses_the_names_its_step_gave_it():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    ok, bad = req("ok", [1, 2, 3, 4, 5]), req("bad", [9, 8, 7, 6, 5])
    prefill(kv, ok), prefill(kv, bad)
    kv.finish_step(failed_req_ids=["bad"])
    kv.free(bad)
    assert list(kv.pool.cached_block_ids) == ok.block_hashes[:1]
    assert kv.get_computed_blocks(req("bad2", [9, 8, 7, 6, 5]))[1] == 0


def test_block_table_updates_send_only_what_the_workers_lack():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(10)))
    prefill(kv, a)
    table = kv.get_block_ids(a)
    assert kv.take_block_table_update(a, whole=True) == (0, table)  # new: the whole table
    a.append_output_token(10)
    assert kv.allocate_slots(a, 1)  # 11 tokens: still 3 blocks
    assert kv.take_block_table_update(a) == (3, [])
    for token in (11, 12):
        a.num_computed_tokens += 1
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1)
    # not scheduled in between: what both allocations added comes at once (the second crossed into block 4)
    assert kv.take_block_table_update(a) == (3, kv.get_block_ids(a)[3:]) and len(kv.get_block_ids(a)) == 4
    kv.trim(a, 9)  # rejected drafts: blocks 3 and 4 go; the workers keep the first three
    assert kv.take_block_table_update(a) == (3, [])
    kv.trim(a, 4)
    assert kv.allocate_slots(a, 8)  # a replaced tail is sent from where it differs
    assert kv.take_block_table_update(a) == (1, kv.get_block_ids(a)[1:])
    assert kv.take_block_table_update(a, whole=True) == (0, kv.get_block_ids(a))  # resumed: whole again
