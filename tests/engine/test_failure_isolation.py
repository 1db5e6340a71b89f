"""A failure inside a step ends only its own requests; the offline engine recovers; only fatal errors kill it."""

from __future__ import annotations

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import EngineDeadError
from llmplug.engine.kv_cache import hash_block
from tests.engine.faults import break_forward, heal, model_runner, nan_logits
from tests.models.tiny_models import make_tiny

KWARGS = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": 4}
PROMPTS = [[i + 1, 7, 9, 11, 13, 2 * i + 3, 5, 5, 40 + i][: 3 + i] for i in range(8)]  # 3..10 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture
def llm(tiny_llama):
    engine = LLM(str(tiny_llama.path), **KWARGS)
    yield engine
    engine.shutdown()


def generate(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def cached_hashes(llm: LLM) -> set[int]:
    return set(llm.llm_engine.engine_core.kv_cache_manager.pool.cached_block_ids)


def prompt_block_hashes(prompts: list[list[int]], block_size: int = 4) -> set[int]:
    """The chained hashes of every full block of the prompts."""
    hashes = set()
    for prompt in prompts:
        parent = None
        for start in range(0, len(prompt) - block_size + 1, block_size):
            parent = hash_block(parent, tuple(prompt[start : start + block_size]))
            hashes.add(parent)
    return hashes


def assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.llm_engine.output_processor.has_unfinished_requests()
    assert not model_runner(llm).sampling_state.requests or llm.step() == []  # the worker forgets them next step
    assert not model_runner(llm).sampling_state.requests


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_nan_logits_in_one_row_of_eight_abort_that_request_only(llm, params):
    clean = generate(llm, params)
    llm.reset_prefix_cache()
    nan_logits(llm, PROMPTS[3])
    outs = generate(llm, params)
    assert outs[3].finish_reason == "abort" and "NaN" in outs[3].error
    assert llm.stats()["num_corrupted_requests"] == 1  # vllm:corrupted_requests: that request, once
    for i, (out, want) in enumerate(zip(outs, clean)):
        if i != 3:
            assert (out.token_ids, out.finish_reason, out.error) == (want.token_ids, "length", None)
    assert_no_leak(llm)
    # the failed request's blocks lost their names: its prompt is computed again, not read from them
    heal(llm)
    again = llm.generate([{"prompt_token_ids": PROMPTS[3]}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == clean[3].token_ids


def test_after_a_failed_step_the_next_generate_works_and_no_block_is_leaked_or_wrongly_named(llm):
    clean = generate(llm, GREEDY)
    llm.reset_prefix_cache()
    # the prefill succeeds; the next steps write NaN K/V and raise
    break_forward(llm, "kernel failed", after=1)
    outs = generate(llm, GREEDY)
    assert all(o.finish_reason == "abort" and "kernel failed" in o.error for o in outs)
    assert_no_leak(llm)
    # the prefill's blocks (full of prompt tokens, K/V written) keep their names; none of a failed step has one
    assert cached_hashes(llm) == prompt_block_hashes(PROMPTS)
    heal(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [c.token_ids for c in clean]
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]  # they hit those blocks
    assert_no_leak(llm)


def test_an_interrupt_escaping_generate_leaves_the_engine_clean(llm):
    clean = generate(llm, GREEDY)
    llm.reset_prefix_cache()
    names_before = cached_hashes(llm)
    break_forward(llm, "interrupted", error=KeyboardInterrupt, after=1)
    with pytest.raises(KeyboardInterrupt):
        generate(llm, GREEDY)
    assert_no_leak(llm)
    heal(llm)
    assert [o.token_ids for o in generate(llm, GREEDY)] == [c.token_ids for c in clean]
    assert names_before <= cached_hashes(llm)


def test_a_raising_logits_processor_ends_its_request_only(llm):
    clean = generate(llm, GREEDY)

    def explode(output_ids, logits):
        if len(output_ids) == 3:
            raise ValueError("processor bug")
        return logits

    params = [GREEDY] * len(PROMPTS)
    params[5] = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logits_processors=[explode])
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
    assert outs[5].finish_reason == "abort" and "processor bug" in outs[5].error
    assert llm.stats()["num_corrupted_requests"] == 0  # a raising processor is no corruption of the logits
    assert outs[5].token_ids == clean[5].token_ids[:3]
    assert [o.token_ids for i, o in enumerate(outs) if i != 5] == [c.token_ids for i, c in enumerate(clean) if i != 5]
    assert_no_leak(llm)


def test_a_fatal_error_kills_the_engine_loudly(llm):
    break_forward(llm, "device lost", error=torch.AcceleratorError)
    with pytest.raises(EngineDeadError, match="device lost"):
        generate(llm, GREEDY)
    heal(llm)  # too late: the device's state cannot be trusted any more
    with pytest.raises(EngineDeadError, match="device lost"):
        generate(llm, GREEDY)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
