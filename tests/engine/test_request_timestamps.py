"""The engine's timestamps of a request (RequestMetrics), which vLLM's queue, prefill, decode and inter-token
metrics are made of: in order, one inter-token latency per step after the first token, on one clock."""

from __future__ import annotations

import pytest

from llmplug import LLM, SamplingParams
from tests.models.tiny_models import make_tiny


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    tiny = make_tiny("llama", tmp_path_factory.mktemp("llama"))
    return LLM(str(tiny.path), dtype="float32", skip_tokenizer_init=True, block_size=4)


@pytest.mark.parametrize("n", [1, 3])
def test_a_finished_request_has_every_timestamp_in_order(llm, n):
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=n, temperature=1.0 if n > 1 else 0.0, seed=1,
                            detokenize=False)
    [output] = llm.generate([{"prompt_token_ids": [1, 5, 9, 13, 17, 21, 25]}], params)
    m = output.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    # the n completions step together: one latency per step after the first token, and they add up to decode
    assert len(m.inter_token_latencies) == 5
    assert sum(m.inter_token_latencies) == pytest.approx(m.last_token_time - m.first_token_time)
    assert all(latency > 0 for latency in m.inter_token_latencies)


def test_a_request_waiting_behind_a_full_batch_is_first_scheduled_later(tmp_path_factory):
    tiny = make_tiny("llama", tmp_path_factory.mktemp("llama1"))
    one_at_a_time = LLM(str(tiny.path), dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_seqs=1)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0, detokenize=False)
    first, second = one_at_a_time.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5, 6]}], params)
    assert second.metrics.first_scheduled_time >= first.metrics.last_token_time  # it waited for the first to end
    assert second.metrics.first_scheduled_time - second.metrics.arrival_time > \
        first.metrics.first_scheduled_time - first.metrics.arrival_time
