"""Scheduler: budgets, chunked prefill, prefix hits, preemption, policies, stops, aborts.

The model is simulated: each step samples the token each test chooses (default: 1000 + position).
"""

from __future__ import annotations

import itertools
import random
from typing import Callable

import pytest

from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import SamplingParams
from llmplug.engine.block_table import BlockTable
from llmplug.engine.kv_cache import KVCacheManager
from llmplug.engine.request import Request, RequestStatus
from llmplug.engine.scheduler import Scheduler
from llmplug.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

EOS = 2


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, prefix_caching: bool = True, **kwargs
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    args = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256) | kwargs
    return Scheduler(kv, **args)


_prompt_starts = itertools.count(10_000, 10_000)


def make_request(req_id: str, prompt: list[int] | int, priority: int = 0, **params) -> Request:
    """A request; an int prompt is that many tokens no other request's prompt shares."""
    if isinstance(prompt, int):
        start = next(_prompt_starts)
        prompt = list(range(start, start + prompt))
    params.setdefault("max_tokens", 4)
    return Request(req_id, prompt, SamplingParams(**params), eos_token_ids=(EOS,), priority=priority)


def default_token(request: Request) -> int:
    return 1000 + request.num_tokens


def step(
    sched: Scheduler, choose: Callable[[Request], int] = default_token
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step: schedule, 'run the model' (sample with `choose`), update."""
    out = sched.schedule()
    sampling = [s.req_id for s in out.requests if s.samples]
    tokens = [[choose(sched.get_request(r))] for r in sampling]
    return out, sched.update_from_output(out, ModelRunnerOutput(sampling, tokens))


def run_until_done(sched: Scheduler, max_steps: int = 500, **kwargs) -> list[SchedulerOutput]:
    outputs = []
    while sched.has_unfinished_requests():
        assert len(outputs) < max_steps, "scheduler made no progress"
        outputs.append(step(sched, **kwargs)[0])
    return outputs


def assert_no_leak(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables
    assert sched.num_running == sched.num_waiting == 0


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    return {s.req_id: len(s.token_ids) for s in out.requests}


# -- the basic life of a request ----------------------------------------------------------------


def test_request_prefills_decodes_and_finishes_at_max_tokens():
    sched = make_scheduler()
    request = make_request("a", 10, max_tokens=3)
    sched.add_request(request)
    out, updated = step(sched)
    (first,) = out.requests
    assert first.token_ids == request.prompt_token_ids and first.num_computed_tokens == 0 and first.samples
    assert first.new is not None and first.new.output_token_ids == [] and first.new_block_ids == [0, 1, 2]
    assert updated == [request] and request.num_computed_tokens == 10
    out, _ = step(sched)
    assert out.requests[0].token_ids == [1010] and out.requests[0].new is None
    # the worker holds the table: a decode within the last block sends no block
    assert out.requests[0].num_kept_blocks == 3 and out.requests[0].new_block_ids == []
    _, updated = step(sched)
    assert updated == [request] and request.status is RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [1010, 1011, 1012]
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.get_request("a") is None
    assert_no_leak(sched)


def test_running_requests_decode_together_with_new_prefills():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    step(sched)
    sched.add_request(make_request("b", 7))
    out, updated = step(sched)
    assert scheduled(out) == {"a": 1, "b": 7} and out.num_scheduled_tokens == 8
    assert [r.request_id for r in updated] == ["a", "b"]
    run_until_done(sched)
    assert_no_leak(sched)


# -- budgets ----------------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_while_decodes_continue():
    sched = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", 3, max_tokens=10)
    sched.add_request(a)
    step(sched)
    b = make_request("b", 20)
    sched.add_request(b)
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        assert scheduled(out)["a"] == 1  # a decodes every step
        chunks.append(next(s for s in out.requests if s.req_id == "b"))
    assert [len(c.token_ids) for c in chunks] == [7, 7, 6]
    assert [c.num_computed_tokens for c in chunks] == [0, 7, 14]
    assert [c.samples for c in chunks] == [False, False, True]
    assert sum((c.token_ids for c in chunks), []) == b.prompt_token_ids
    assert [c.new is not None for c in chunks] == [True, False, False]
    assert b.num_output_tokens == 1
    run_until_done(sched)
    assert_no_leak(sched)


def test_without_chunked_prefill_a_prompt_is_scheduled_whole_or_waits():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 5))
    out, _ = step(sched)
    assert scheduled(out) == {"a": 8}  # b does not fit the 2 tokens left, and is not split
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1, "b": 5}
    run_until_done(sched)
    assert_no_leak(sched)


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for name in "abc":
        sched.add_request(make_request(name, 4, max_tokens=2))
    out, _ = step(sched)
    assert set(scheduled(out)) == {"a", "b"} and sched.num_waiting == 1
    out, _ = step(sched)  # a and b finish here
    assert set(scheduled(out)) == {"a", "b"}
    out, _ = step(sched)
    assert set(scheduled(out)) == {"c"} and out.finished_req_ids == {"a", "b"}
    run_until_done(sched)
    assert_no_leak(sched)


# -- prefix caching ---------------------------------------------------------------------------


def test_prefix_hit_skips_cached_tokens_even_within_one_step():
    sched = make_scheduler()
    prompt = list(range(10))
    a, b = make_request("a", prompt), make_request("b", prompt)  # like the n=2 children of one prompt
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    sa, sb = out.requests
    assert sa.num_computed_tokens == 0 and len(sa.token_ids) == 10
    assert sb.num_computed_tokens == 8 and sb.token_ids == prompt[8:]
    assert sb.new_block_ids[:2] == sa.new_block_ids[:2] and sb.new_block_ids[2] != sa.new_block_ids[2]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert sched.kv_cache_manager.prefix_cache_stats.hits == 8
    run_until_done(sched)
    assert_no_leak(sched)


# -- preemption -------------------------------------------------------------------------------


def fill_two_requests(sched: Scheduler, **params) -> tuple[Request, Request]:
    """Two 6-token requests in a 4-block cache (block size 4), run until one needs a third block."""
    a, b = make_request("a", 6, **params), make_request("b", 6, **params)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(3):  # prefill (7 tokens), then decodes reaching 8 tokens: two blocks each
        out, _ = step(sched)
        assert not out.preempted_req_ids
    return a, b


def test_preemption_by_recompute_and_resume_with_output_tokens():
    sched = make_scheduler(num_blocks=4, prefix_caching=False)
    a, b = fill_two_requests(sched, max_tokens=5)
    out, _ = step(sched)  # a needs a third block: b, the latest arrival, is preempted
    assert out.preempted_req_ids == {"b"} and scheduled(out) == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1 and sched.num_waiting == 1
    outputs_before = list(b.output_token_ids)
    assert outputs_before == [1006, 1007, 1008]
    outputs = run_until_done(sched)
    resumed = next(s for o in outputs for s in o.requests if s.req_id == "b" and s.new is not None)
    assert resumed.new.prompt_token_ids == b.prompt_token_ids
    assert resumed.new.output_token_ids == outputs_before
    assert resumed.token_ids == b.prompt_token_ids + outputs_before and resumed.num_computed_tokens == 0
    assert resumed.samples
    assert a.output_token_ids == b.output_token_ids == [1006, 1007, 1008, 1009, 1010]
    assert_no_leak(sched)


def test_preempted_request_resumes_from_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=4)
    a, b = fill_two_requests(sched, max_tokens=5)
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"}
    outputs = run_until_done(sched)
    resumed = next(s for o in outputs for s in o.requests if s.req_id == "b" and s.new is not None)
    # b's tail block went to a (freed tail first, so evicted first); its head block was still cached.
    assert resumed.num_computed_tokens == 4
    assert resumed.token_ids == b.prompt_token_ids[4:] + [1006, 1007, 1008]
    assert b.num_cached_tokens == 0  # num_cached_tokens records the first scheduling only
    assert b.output_token_ids == [1006, 1007, 1008, 1009, 1010]
    assert_no_leak(sched)


def test_request_that_cannot_grow_preempts_itself_and_is_capped_by_the_cache():
    sched = make_scheduler(num_blocks=3, prefix_caching=False)
    a, b = make_request("a", 3, max_tokens=3), make_request("b", 8, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 1 block, b: 2 blocks -> the cache is full
    out, _ = step(sched)  # a still fits its block; b needs a third and is itself the last running
    assert out.preempted_req_ids == {"b"} and scheduled(out) == {"a": 1}
    outputs = run_until_done(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 3
    # b cannot grow past the 12 tokens the cache holds: it ends with "length" instead of looping.
    assert b.num_tokens == 12 and b.status is RequestStatus.FINISHED_LENGTH
    assert sum(1 for o in outputs for s in o.requests if s.req_id == "b" and s.new) == 1
    assert_no_leak(sched)


# -- policies ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "expected"), [("fcfs", ["a", "b", "c"]), ("priority", ["b", "c", "a"])])
def test_admission_order_follows_policy(policy, expected):
    sched = make_scheduler(max_num_seqs=1, policy=policy)
    for name, priority in (("a", 5), ("b", 0), ("c", 1)):
        sched.add_request(make_request(name, 4, priority=priority, max_tokens=1))
    order = [out.requests[0].req_id for out in run_until_done(sched)]
    assert order == expected
    assert_no_leak(sched)


def test_priority_preemption_picks_the_lowest_priority_running_request():
    sched = make_scheduler(num_blocks=4, prefix_caching=False, policy="priority")
    low, high = make_request("low", 6, priority=9), make_request("high", 6, priority=0)
    sched.add_request(low)  # arrives first, but has the lower priority
    sched.add_request(high)
    out, _ = step(sched)
    assert [s.req_id for s in out.requests] == ["high", "low"]
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert out.preempted_req_ids == {"low"} and scheduled(out) == {"high": 1}
    run_until_done(sched)
    assert_no_leak(sched)


# -- admission checks -------------------------------------------------------------------------


def test_rejects_prompt_longer_than_max_model_len():
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(InvalidRequestError, match=r"prompt of 16 tokens .*max_model_len=16"):
        sched.add_request(make_request("a", 16))
    sched.add_request(make_request("b", 15))


def test_rejects_prompt_needing_more_blocks_than_the_cache():
    sched = make_scheduler(num_blocks=4)  # 16 tokens
    with pytest.raises(InvalidRequestError, match=r"prompt of 16 tokens .*needs 5 KV blocks .*cache holds 4"):
        sched.add_request(make_request("a", 16))


def test_rejects_prompt_over_the_batch_budget_without_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(InvalidRequestError, match=r"prompt of 9 tokens exceeds max_num_batched_tokens=8"):
        sched.add_request(make_request("a", 9))
    assert not sched.has_unfinished_requests()


def test_rejects_duplicate_request_id():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(InvalidRequestError, match="already"):
        sched.add_request(make_request("a", 4))


# -- stop conditions --------------------------------------------------------------------------


def generate(request: Request, tokens: list[int], **kwargs) -> Request:
    """Run one request alone, sampling `tokens` in order."""
    sched = make_scheduler(**kwargs)
    sched.add_request(request)
    stream = iter(tokens)
    run_until_done(sched, choose=lambda r: next(stream))
    assert_no_leak(sched)
    return request


def test_eos_stops():
    request = generate(make_request("a", 4, max_tokens=10), [5, 6, EOS, 7])
    assert request.output_token_ids == [5, 6, EOS] and request.status.finish_reason == "stop"
    assert request.stop_reason is None


def test_ignore_eos_keeps_generating_until_max_tokens():
    request = generate(make_request("a", 4, max_tokens=3, ignore_eos=True), [EOS, EOS, EOS, EOS])
    assert request.output_token_ids == [EOS] * 3 and request.status.finish_reason == "length"


def test_stop_token_id_stops_and_is_the_stop_reason():
    request = generate(make_request("a", 4, max_tokens=10, stop_token_ids=[42]), [5, 42, 6])
    assert request.output_token_ids == [5, 42] and request.stop_reason == 42
    assert request.status is RequestStatus.FINISHED_STOPPED


def test_min_tokens_defers_eos_and_stop_tokens():
    request = generate(make_request("a", 4, max_tokens=10, min_tokens=3, stop_token_ids=[42]), [EOS, 42, 42, 9])
    assert request.output_token_ids == [EOS, 42, 42] and request.stop_reason == 42


def test_max_model_len_finishes_with_length():
    request = generate(make_request("a", 6, max_tokens=None), [5] * 10, max_model_len=8)
    assert request.num_tokens == 8 and request.status is RequestStatus.FINISHED_LENGTH


# -- aborts -----------------------------------------------------------------------------------


def test_abort_of_waiting_and_running_requests_frees_blocks():
    sched = make_scheduler(max_num_seqs=1)
    running, waiting = make_request("run", 9, max_tokens=50), make_request("wait", 4)
    sched.add_request(running)
    sched.add_request(waiting)
    out = sched.schedule()  # the worker runs this step while the abort arrives
    sched.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    updated = sched.update_from_output(out, ModelRunnerOutput(["run"], [[7]]))
    assert updated == [] and running.output_token_ids == []
    assert running.status.finish_reason == waiting.status.finish_reason == "abort"
    assert sched.schedule().finished_req_ids == {"run", "wait"}
    assert not sched.has_unfinished_requests()
    assert_no_leak(sched)


def test_abort_of_preempted_request_and_unknown_ids():
    sched = make_scheduler(num_blocks=4, prefix_caching=False)
    fill_two_requests(sched, max_tokens=9)
    out, _ = step(sched)
    assert out.preempted_req_ids == {"b"}
    sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    sched.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED)  # no-ops
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)
    run_until_done(sched)
    assert_no_leak(sched)


# -- invariants under load --------------------------------------------------------------------


def check_block_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    refs = [0] * kv.num_blocks
    for table in kv.block_tables.values():
        for block_id in table:
            refs[block_id] += 1
    assert [b.ref_count for b in kv.pool.blocks] == refs
    assert set(kv.pool.free_block_ids) == {i for i, r in enumerate(refs) if r == 0}
    for block_hash, block_id in kv.pool.cached_block_ids.items():
        assert kv.pool.blocks[block_id].block_hash == block_hash
    assert set(kv.block_tables) == {r.request_id for r in sched.running}
    assert sched.num_running <= sched.max_num_seqs


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_load_with_aborts_keeps_blocks_consistent_and_leaks_nothing(policy):
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=12, max_num_seqs=6, max_num_batched_tokens=24, policy=policy)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    worker = BlockTable()  # the worker's copy, kept from the steps' updates alone
    for i in range(150):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]
            sched.add_request(make_request(f"r{i}", prompt, priority=rng.randrange(3), max_tokens=rng.randrange(1, 20)))
        if rng.random() < 0.1 and sched.requests:
            sched.finish_requests(rng.choice(list(sched.requests)), RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        worker.apply(out)
        for s in out.requests:
            table = sched.kv_cache_manager.block_tables[s.req_id]
            assert worker.block_ids(s.req_id) == table and len(table) * 4 >= s.num_computed_tokens + len(s.token_ids)
        sampling = [s.req_id for s in out.requests if s.samples]
        tokens = [[rng.randrange(3, 60)] for _ in sampling]
        sched.update_from_output(out, ModelRunnerOutput(sampling, tokens))
        check_block_invariants(sched)
    for out in run_until_done(sched) + [sched.schedule()]:
        worker.apply(out)
    assert sched.num_preemptions > 0 and sched.kv_cache_manager.prefix_cache_stats.hits > 0
    assert_no_leak(sched)
    assert worker.row_of == {}  # every finished request's row was dropped


def test_a_request_whose_adapter_has_no_slot_is_deferred_the_others_wait_for_capacity():
    from llmplug.lora.request import LoRARequest

    sched = make_scheduler(max_loras=1, max_num_seqs=2)
    adapters = [None, LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b"), LoRARequest("a", 1, "/a"), None]
    for i, lora in enumerate(adapters):
        request = make_request(f"r{i}", 6)
        request.lora_request = lora
        sched.add_request(request)
    step(sched)  # r0 and r1 run (max_num_seqs=2): adapter a holds the only slot
    assert sched.num_waiting == 3
    assert sched.num_waiting_deferred == 1  # r2 needs a slot for b; r3 (adapter a) and r4 wait their turn
    run_until_done(sched)
    assert sched.num_waiting_deferred == 0
