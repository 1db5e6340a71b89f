"""Recurrent-state slots of a hybrid model (Mamba 2 + attention) through the whole engine: each running
request owns one slot besides its blocks, freed on finish, abort and preemption; nothing leaks, and a
slot reused by a later request starts from a clean state (its outputs still match transformers)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import BambaConfig

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ConfigError
from llmplug.testing import TinyCheckpoint, save_tiny_checkpoint, tiny_config
from tests.models.cases_recurrent import BAMBA_SIZES

MAX_NUM_SEQS = 6
# the tiny hybrid's memory, from its transformers config: one Mamba 2 layer (conv window over x, B, C of
# 128 + 2 * 2 * 8 channels and kernel 4; SSM state 8 heads x 16 x 8) and one attention layer (2 kv heads of 16)
SLOT_BYTES = 4 * ((128 + 2 * 2 * 8) * 3 + 8 * 16 * 8)
BLOCK_BYTES = 4 * 2 * 4 * 2 * 16  # float32, K and V, block_size 4


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    config = tiny_config(BambaConfig, attn_layer_indices=[1], **BAMBA_SIZES)
    return save_tiny_checkpoint(config, tmp_path_factory.mktemp("bamba"))


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_200_requests_with_aborts_and_preemptions_leak_no_block_and_no_state_slot(tiny_hybrid) -> None:
    # few blocks (preemption), a small step budget (chunked prefill), fewer slots than requests
    llm = LLM(str(tiny_hybrid.path), dtype="float32", skip_tokenizer_init=True, block_size=4,
              num_gpu_blocks_override=24, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=12,
              device={"num_threads": 1})
    engine, rng = llm.llm_engine, random.Random(0)
    kv = engine.engine_core.kv_cache_manager
    assert not kv.enable_prefix_caching  # a recurrent state cannot be restored from cached blocks
    requests = {
        str(i): ([rng.randrange(256) for _ in range(rng.randint(1, 30))], rng.randint(1, 16)) for i in range(200)
    }
    pending, live, finished, aborted = list(requests), set(), {}, set()
    while pending or engine.has_unfinished_requests():
        for req_id in pending[:3]:  # a few arrivals per step
            prompt, max_tokens = requests[req_id]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
            live.add(req_id)
        del pending[:3]
        if live and rng.random() < 0.3:  # abort a waiting or running request now and then
            victim = rng.choice(sorted(live))
            engine.abort_request([victim])
            live.discard(victim)
            aborted.add(victim)
        for out in engine.step():
            if out.finished and out.request_id in live:
                finished[out.request_id] = list(out.outputs[0].token_ids)
                live.discard(out.request_id)
    preemptions = engine.engine_core.scheduler.num_preemptions
    llm.shutdown()
    assert len(finished) + len(aborted) == 200 and len(aborted) >= 20 and preemptions > 0
    assert kv.num_free_blocks == kv.num_blocks and not kv.block_tables
    assert kv.num_free_state_slots == MAX_NUM_SEQS and not kv.state_slots
    # slots were reused after finishes, aborts and preemptions: the last requests still match transformers
    for req_id in sorted(finished, key=int)[-6:]:
        prompt, max_tokens = requests[req_id]
        assert finished[req_id] == hf_greedy(tiny_hybrid.hf_model, prompt, max_tokens), req_id


def test_the_state_slots_come_out_of_the_kv_cache_budget_first(tiny_hybrid) -> None:
    engine_kwargs = dict(dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_seqs=4,
                         device={"num_threads": 1})
    with pytest.raises(ConfigError, match="recurrent state of scheduler.max_num_seqs=4 requests needs"):
        LLM(str(tiny_hybrid.path), kv_cache_memory=4 * SLOT_BYTES - 1, **engine_kwargs)
    llm = LLM(str(tiny_hybrid.path), kv_cache_memory=4 * SLOT_BYTES + 10 * BLOCK_BYTES, **engine_kwargs)
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert (kv.num_blocks, kv.num_free_state_slots) == (10, 4)
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    llm.shutdown()
    assert list(out) == hf_greedy(tiny_hybrid.hf_model, prompt, 4)
