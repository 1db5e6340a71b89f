"""The engine's tokens-per-step histogram: Prometheus's bucket rule (a value equal to a bound falls in it), and
one observation per step that ran the model, of the tokens it scheduled."""

from __future__ import annotations

import pytest

from llmplug import LLM, SamplingParams
from llmplug.engine.step_histogram import ITERATION_TOKENS_BUCKETS, StepHistogram
from tests.models.tiny_models import make_tiny


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


def test_values_fall_in_the_first_bucket_whose_bound_they_do_not_exceed():
    hist = StepHistogram((1, 8, 16))
    for value in (1, 2, 8, 9, 16, 17, 1000):
        hist.observe(value)
    snap = hist.snapshot()
    assert snap.counts == (1, 2, 2, 2) and snap.count == 7 and snap.sum == 1053
    hist.observe(3)
    assert snap.counts == (1, 2, 2, 2)  # a snapshot does not move with later steps
    assert ITERATION_TOKENS_BUCKETS[:3] == (1, 8, 16) and ITERATION_TOKENS_BUCKETS[-1] == 16384


def test_the_engine_observes_every_step_with_its_scheduled_tokens(tiny_llama):
    llm = LLM(str(tiny_llama.path), dtype="float32", skip_tokenizer_init=True, block_size=4,
              max_num_batched_tokens=8, enable_prefix_caching=False)
    core = llm.llm_engine.engine_core
    steps = []
    original = core.scheduler.schedule

    def recording_schedule():
        out = original()
        steps.append(out.num_scheduled_tokens)
        return out

    core.scheduler.schedule = recording_schedule
    prompt = list(range(5, 25))  # 20 tokens in chunks of 8: 8, 8, 4 (+ nothing sampled until the last)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    snap = llm.stats()["iteration_tokens"]
    ran = [n for n in steps if n]
    assert ran[:3] == [8, 8, 4] and len(ran) == 5  # three prompt chunks, then two one-token decode steps
    assert snap.count == len(ran) and snap.sum == sum(ran) == 22
    assert snap.counts[0] == 2 and snap.counts[1] == 3  # two steps of 1 token; 4, 8, 8 are <= 8
    llm.shutdown()
