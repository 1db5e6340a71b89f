"""Cross blocks of encoder-decoder requests (Whisper): the KV manager gives each its encoder's blocks from the same pool
as its decoder blocks; the scheduler admits it only when both fit and frees both at finish and preemption."""

from __future__ import annotations

import pytest

from llmplug.core.errors import InvalidRequestError
from llmplug.engine.kv_cache import KVCacheManager
from llmplug.engine.multimodal import MultiModalFeature
from llmplug.engine.request import Request, RequestStatus
from tests.engine.test_scheduler import assert_no_leak, make_request, make_scheduler, step

BS = 4


def with_audio(request: Request, clip: str = "clip-a", num_encoder_tokens: int = 10) -> Request:
    """The request as an encoder-decoder one: its clip has `num_encoder_tokens` encoder states."""
    request.encoder_feature = MultiModalFeature("audio", clip, {}, 0, num_encoder_tokens)
    return request


def admit(kv: KVCacheManager, request: Request) -> bool:
    blocks, num_cached = kv.get_computed_blocks(request)
    return kv.allocate_slots(request, request.num_tokens - num_cached, blocks)


def test_a_request_takes_its_cross_blocks_with_its_first_blocks_and_frees_both():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    a = with_audio(make_request("a", 5), num_encoder_tokens=10)  # 3 cross blocks, 2 decoder blocks
    assert kv.num_cross_blocks(a) == 3
    assert admit(kv, a)
    cross, written = kv.get_cross_blocks(a)
    assert len(cross) == 3 and not written and not set(cross) & set(kv.get_block_ids(a))
    assert kv.num_free_blocks == 15
    a.num_computed_tokens = a.num_tokens
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1) and kv.get_cross_blocks(a) == (cross, False)  # growing takes no cross block
    kv.free(a)
    assert kv.num_free_blocks == 20 and not kv.cross_block_tables and not kv.block_tables


def test_a_request_is_admitted_only_when_both_lists_fit():
    kv = KVCacheManager(num_blocks=7, block_size=BS)
    assert admit(kv, with_audio(make_request("a", 5)))  # 2 + 3 blocks
    b = with_audio(make_request("b", 4), clip="clip-b")  # 1 + 3 > the 2 left, though its decoder block would fit
    assert not admit(kv, b)
    assert kv.num_free_blocks == 2 and "b" not in kv.block_tables and "b" not in kv.cross_block_tables
    assert admit(kv, make_request("c", 8))  # a decoder-only request of 2 blocks does fit


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_same_clip_shares_cross_blocks_through_the_prefix_cache(prefix_caching):
    kv = KVCacheManager(num_blocks=40, block_size=BS, enable_prefix_caching=prefix_caching)
    a = with_audio(make_request("a", 5))
    assert admit(kv, a)
    kv.finish_step()
    b, c = with_audio(make_request("b", 6)), with_audio(make_request("c", 5), clip="clip-c")
    assert admit(kv, b) and admit(kv, c)
    shared = kv.get_cross_blocks(b)
    assert shared == ((kv.get_cross_blocks(a)[0], True) if prefix_caching else (shared[0], False))
    assert set(kv.get_cross_blocks(c)[0]).isdisjoint(kv.get_cross_blocks(a)[0]) and not kv.get_cross_blocks(c)[1]
    assert kv.num_free_blocks == 40 - 2 - 2 - 2 - (3 if prefix_caching else 6) - 3
    for request in (a, b, c):
        kv.free(request)
    assert kv.num_free_blocks == 40


def test_a_failed_encoder_takes_back_the_names_of_its_cross_blocks():
    kv = KVCacheManager(num_blocks=40, block_size=BS)
    a = with_audio(make_request("a", 5))
    assert admit(kv, a)
    kv.finish_step(failed_req_ids=["a"])  # its encoder raised: its cross blocks hold nothing
    kv.free(a)
    b = with_audio(make_request("b", 5))
    assert admit(kv, b) and not kv.get_cross_blocks(b)[1]  # the same clip misses: its encoder runs


def test_cross_blocks_take_consecutive_ids_where_the_free_blocks_hold_a_run():
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_prefix_caching=False)
    holders = [make_request(f"h{i}", 4) for i in range(12)]  # one block each: blocks 0 .. 11
    for holder in holders:
        assert admit(kv, holder)
    for i in (1, 3, 4, 5, 7, 9, 10, 0):
        kv.free(holders[i])  # free, least recently freed first: 1, 3, 4, 5, 7, 9, 10, 0
    a = with_audio(make_request("a", 3), num_encoder_tokens=12)  # 3 cross blocks, 1 decoder block
    assert admit(kv, a) and kv.get_cross_blocks(a)[0] == [3, 4, 5] and kv.get_block_ids(a) == [1]
    b = with_audio(make_request("b", 3), clip="clip-b", num_encoder_tokens=8)  # free: 7, 9, 10, 0
    assert admit(kv, b) and kv.get_cross_blocks(b)[0] == [9, 10] and kv.get_block_ids(b) == [7]
    kv.free(holders[6])
    kv.free(holders[2])  # free: 0, 6, 2: no run of two, so the least recently freed
    c = with_audio(make_request("c", 3), clip="clip-c", num_encoder_tokens=8)
    assert admit(kv, c) and kv.get_cross_blocks(c)[0] == [0, 6] and kv.get_block_ids(c) == [2]


def _run_checking_cross_blocks(sched) -> tuple[int, int]:
    """Run to the end; after each step every running request holds its cross blocks and no other request does, and
    each admission sends them. Returns (most requests running at once, preemptions)."""
    kv, most = sched.kv_cache_manager, 0
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        for scheduled in out.requests:
            if scheduled.new is not None:
                assert scheduled.new.cross_block_ids == kv.get_cross_blocks(sched.get_request(scheduled.req_id))[0]
        assert set(kv.cross_block_tables) == {r.request_id for r in sched.running}
        assert all(len(blocks) == 3 for blocks in kv.cross_block_tables.values())
        most = max(most, len(sched.running))
    return most, sched.num_preemptions


def test_the_scheduler_runs_as_many_as_both_lists_allow_and_preemption_frees_both():
    # each request: 3 cross blocks, and 3 decoder blocks at its end (4 prompt tokens + 6); room for two at admission,
    # too little for two at their end: one is preempted
    sched = make_scheduler(num_blocks=2 * 3 + 3, block_size=BS, max_num_seqs=8)
    for i in range(4):
        sched.add_request(with_audio(make_request(f"r{i}", 4, max_tokens=6), clip=f"clip-{i}"))
    most, preemptions = _run_checking_cross_blocks(sched)
    assert most == 2 and preemptions > 0
    assert_no_leak(sched)
    assert not sched.kv_cache_manager.cross_block_tables


def test_a_request_whose_blocks_cannot_fit_the_cache_is_refused_and_the_next_is_served():
    sched = make_scheduler(num_blocks=4, block_size=BS)
    with pytest.raises(InvalidRequestError, match="needs 2 KV blocks of 4 tokens and 3 cross blocks"):
        sched.add_request(with_audio(make_request("big", 4)))
    sched.add_request(with_audio(make_request("ok", 4, max_tokens=2), num_encoder_tokens=4))
    while sched.has_unfinished_requests():
        step(sched)
    assert_no_leak(sched)


def test_a_request_grows_only_to_the_blocks_its_cross_blocks_leave():
    sched = make_scheduler(num_blocks=6, block_size=BS)  # 3 cross blocks leave 3 blocks: 12 tokens
    request = with_audio(make_request("a", 4, max_tokens=100))
    sched.add_request(request)
    while sched.has_unfinished_requests():
        step(sched)
    assert request.status is RequestStatus.FINISHED_LENGTH and request.num_tokens == 12
    assert sched.num_preemptions == 0
    assert_no_leak(sched)
