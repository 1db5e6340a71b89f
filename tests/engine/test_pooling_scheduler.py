"""The scheduler's pooling path: whole prompts only, no KV cache, done in the step that ran them."""

from __future__ import annotations

import pytest

from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import PoolingParams, SamplingParams
from llmplug.engine.request import Request, RequestStatus
from llmplug.engine.scheduler import Scheduler
from llmplug.engine.scheduler_output import ModelRunnerOutput


def pooling_scheduler(budget: int = 16) -> Scheduler:
    return Scheduler(None, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=32)


def pooling_request(req_id: str, num_tokens: int) -> Request:
    return Request(req_id, list(range(5, 5 + num_tokens)), None, pooling_params=PoolingParams(task="embed"))


def test_pooling_prompts_run_whole_and_finish_in_their_step() -> None:
    sched = pooling_scheduler(budget=16)
    for req_id, n in [("a", 10), ("b", 9), ("c", 6), ("d", 16)]:
        sched.add_request(pooling_request(req_id, n))
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert all(s.pools and not s.samples and s.new_block_ids == [] for s in out.requests)
        assert all(len(s.token_ids) == sched.requests[s.req_id].num_prompt_tokens for s in out.requests)
        done = sched.update_from_output(out, ModelRunnerOutput([], []))
        assert {r.request_id for r in done} == {s.req_id for s in out.requests}
        assert all(r.status is RequestStatus.FINISHED_STOPPED for r in done)
        steps.append([s.req_id for s in out.requests])
    # FCFS and never split: b does not fit next to a (10 + 9 > 16), c waits for b rather than overtaking
    assert steps == [["a"], ["b", "c"], ["d"]]
    assert sched.make_stats().kv_cache_usage == 0.0


def test_a_pooling_prompt_longer_than_a_step_is_refused_with_the_fix() -> None:
    sched = pooling_scheduler(budget=16)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens=16, and pooling prompts run whole"):
        sched.add_request(pooling_request("long", 17))
    sched.add_request(pooling_request("ok", 16))
    assert [s.req_id for s in sched.schedule().requests] == ["ok"]


def test_a_pooling_engine_refuses_generation_requests() -> None:
    sched = pooling_scheduler()
    with pytest.raises(InvalidRequestError, match="generation request in an engine that does not serve it"):
        sched.add_request(Request("gen", [5, 6, 7], SamplingParams()))
