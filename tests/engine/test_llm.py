"""The whole engine (LLM class) against HF transformers on tiny random Llama-family models."""

from __future__ import annotations

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ConfigError, InvalidRequestError
from llmplug.core.params import RequestOutputKind
from tests.models.tiny_models import ARCHS, make_tiny

MAX_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    return make_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


def prompts(seed: int = 0, lengths=(3, 11, 7, 20, 1, 14)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(hf_model, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():  # an explicit mask: without one, HF masks prompt tokens equal to pad_token_id
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_llm(tiny, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": 4, **kwargs}
    return LLM(str(tiny.path), **kwargs)


def generate_ids(llm: LLM, token_prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

# (name, engine keywords): each variant exercises another path of the scheduler and attention
VARIANTS = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 6},
    "preemption": {"num_gpu_blocks_override": 24, "max_num_seqs": 6},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf_generate(tiny, variant):
    llm = make_llm(tiny, **VARIANTS[variant])
    batch = prompts()
    got = generate_ids(llm, batch, GREEDY)
    expected = [hf_greedy(tiny.hf_model, p) for p in batch]
    assert got == expected
    assert_no_leak(llm)
    if variant == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_prefix_cache_hits_keep_outputs(tiny_llama):
    llm = make_llm(tiny_llama)
    shared = prompts(1, (12,))[0]
    batch = [shared + tail for tail in prompts(2, (3, 5, 1))]
    first = generate_ids(llm, batch[:1], GREEDY)
    rest = generate_ids(llm, batch[1:], GREEDY)  # the shared 3 blocks are cached by now
    stats = llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats
    assert stats.hits >= 2 * 12
    assert first + rest == [hf_greedy(tiny_llama.hf_model, p) for p in batch]
    assert_no_leak(llm)


def test_logits_match_hf_through_logprobs(tiny_llama):
    llm = make_llm(tiny_llama)
    batch = prompts(3, (5, 9))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(batch, outs):
        seq = prompt + list(out.outputs[0].token_ids)
        with torch.inference_mode():
            ref = torch.log_softmax(tiny_llama.hf_model(torch.tensor([seq])).logits[0].float(), -1)
        for i, (token, position) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert token == int(row.argmax())
            for tid, lp in position.items():
                worst = max(worst, abs(lp.logprob - float(row[tid])))
    assert worst < 1e-3, f"max abs logprob diff {worst}"


def test_seeded_sampling_is_batch_independent(tiny_llama):
    llm = make_llm(tiny_llama)
    target = prompts(4, (6,))[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = generate_ids(llm, [target], seeded)[0]
    others = prompts(5, tuple(range(2, 17)))
    mixed = [SamplingParams(temperature=0.7 + 0.02 * i, seed=None if i % 2 else i, max_tokens=16, ignore_eos=True)
             for i in range(15)]
    batch = generate_ids(llm, others[:7] + [target] + others[7:], mixed[:7] + [seeded] + mixed[7:])
    assert batch[7] == alone
    assert_no_leak(llm)


def test_n_completions_share_the_prompt(tiny_llama):
    llm = make_llm(tiny_llama)
    prompt = prompts(6, (13,))[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct seeds per completion
    assert llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats.hits > 0
    assert_no_leak(llm)


def test_generate_asks_the_engine_for_final_outputs_only_and_leaves_the_params_given_alone(tiny_llama):
    """As vLLM's LLM: the engine answers each request once, finished (no output built a step); the caller's
    SamplingParams keep their output kind; one params object for several prompts and n completions still work."""
    llm = make_llm(tiny_llama)
    stepped = []
    step = llm.llm_engine.step

    def recorded_step():
        outs = step()
        stepped.extend(outs)
        return outs

    llm.llm_engine.step = recorded_step
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(2, (5, 9, 4))], params, use_tqdm=False)
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert len(stepped) == 3 and all(o.finished for o in stepped)
    assert all(len(o.outputs) == 2 and all(len(c.token_ids) == 6 for c in o.outputs) for o in outs)
    assert generate_ids(llm, prompts(), GREEDY) == [hf_greedy(tiny_llama.hf_model, p) for p in prompts()]
    assert_no_leak(llm)


def test_max_tokens_and_stop_token_ids(tiny_llama):
    llm = make_llm(tiny_llama)
    prompt = prompts(7, (5,))[0]
    free = generate_ids(llm, [prompt], GREEDY)[0]
    stop_at = free[5]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_at])
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert list(out.token_ids) == free[: free.index(stop_at) + 1]
    short = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=3),
                         use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 999999]}, "vocabulary"),
        ({"prompt_token_ids": [1] * 300}, "context length"),
        ("text without a tokenizer", "tokenizer"),
    ],
)
def test_bad_prompt_is_a_clear_error_and_engine_keeps_working(tiny_llama, bad, message):
    llm = make_llm(tiny_llama)
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, bad], GREEDY, use_tqdm=False)
    assert_no_leak(llm)
    assert generate_ids(llm, [[1, 2, 3]], GREEDY) == [hf_greedy(tiny_llama.hf_model, [1, 2, 3])]


def test_a_max_model_len_past_the_models_positions_is_refused_unless_allowed_as_in_vllm(tiny_llama, monkeypatch):
    positions = tiny_llama.hf_model.config.max_position_embeddings
    with pytest.raises(ConfigError, match=rf"max_model_len={positions + 1} exceeds the model's {positions} positions"
                                          r".*VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"):
        make_llm(tiny_llama, max_model_len=positions + 1)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = make_llm(tiny_llama, max_model_len=positions + 1)
    assert llm.llm_engine.engine_core.max_model_len == positions + 1
    assert generate_ids(llm, [[1, 2, 3]], GREEDY) == [hf_greedy(tiny_llama.hf_model, [1, 2, 3])]


def test_step_by_step_and_abort(tiny_llama):
    llm = make_llm(tiny_llama)
    keep = llm.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
    drop = llm.add_request({"prompt_token_ids": [8, 9]}, GREEDY)
    llm.step()
    llm.abort(drop)
    finished = {}
    while llm.llm_engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in llm.step() if o.finished})
    assert drop not in finished
    assert list(finished[keep].outputs[0].token_ids) == hf_greedy(tiny_llama.hf_model, [5, 6, 7])
    assert_no_leak(llm)


def assert_prompt_logprobs_match_hf(hf_model, prompt: list[int], out) -> None:
    """One prompt logprob per position after the first, each transformers' within 1e-4."""
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], -1)
    assert len(out.prompt_logprobs or [None]) == len(prompt) and (out.prompt_logprobs or [None])[0] is None
    for pos in range(1, len(prompt)):
        assert out.prompt_logprobs[pos][prompt[pos]].logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)


def test_prompt_logprobs_cover_every_position_even_with_a_cached_prefix(tiny_llama):
    llm = make_llm(tiny_llama)
    prompt = prompts(8, (14,))[0]
    generate_ids(llm, [prompt], GREEDY)  # caches the prompt's full blocks
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert_prompt_logprobs_match_hf(tiny_llama.hf_model, prompt, out)
    assert_no_leak(llm)


def test_prompt_logprobs_of_every_chunk_of_a_chunked_prefill_reach_the_output(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=6)  # the 14-token prompt takes three steps
    prompt = prompts(9, (14,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert_prompt_logprobs_match_hf(tiny_llama.hf_model, prompt, out)
    assert_no_leak(llm)


def test_prompt_logprobs_are_sent_once_when_a_request_is_preempted_and_recomputed(tiny_llama):
    llm = make_llm(tiny_llama, **VARIANTS["preemption"])
    batch = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert_prompt_logprobs_match_hf(tiny_llama.hf_model, prompt, out)
    assert_no_leak(llm)


def test_llm_reads_a_config_file_and_keywords_override_it(tiny_llama, tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text(f"model:\n  model: {tiny_llama.path}\n  dtype: float32\n  skip_tokenizer_init: true\n"
                    "cache:\n  block_size: 8\nscheduler:\n  max_num_seqs: 3\n")
    llm = LLM(config=path, max_num_seqs=5)
    assert llm.config.cache.block_size == 8 and llm.config.scheduler.max_num_seqs == 5
    assert generate_ids(llm, [[4, 5, 6]], GREEDY) == [hf_greedy(tiny_llama.hf_model, [4, 5, 6])]


def test_every_eos_id_of_the_generation_config_stops_the_request(tiny_llama, tmp_path):
    import json
    import shutil

    prompt = [3, 1, 4, 1, 5]
    reference = hf_greedy(tiny_llama.hf_model, prompt)
    eos = reference[4]  # a token the model will generate, declared as the second of several eos ids
    path = shutil.copytree(tiny_llama.path, tmp_path / "model")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [255, eos]}))
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    assert llm.llm_engine.eos_token_ids == (255, eos)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0].outputs[0]
    stop_at = reference.index(eos) + 1
    assert out.token_ids == reference[:stop_at] and out.finish_reason == "stop"
    ignore = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert generate_ids(llm, [prompt], ignore) == [reference]
    held = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=stop_at + 1)  # eos masked till then
    assert eos not in generate_ids(llm, [prompt], held)[0][: stop_at + 1]


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 8},  # the prompt is computed in chunks of 8
    {"max_num_batched_tokens": 8, "num_gpu_blocks_override": 12, "max_num_seqs": 4},  # and preempted, recomputed
], ids=["chunked_prefill", "chunked_and_preempted"])
def test_prompt_logprobs_come_once_per_request_with_n_completions(tiny_llama, engine_kwargs):
    llm = make_llm(tiny_llama, **engine_kwargs)
    prompt = prompts(3, (30,))[0]
    with torch.inference_mode():
        top = torch.log_softmax(tiny_llama.hf_model(torch.tensor([prompt])).logits[0], -1).topk(3, dim=-1)
    params = SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=20, ignore_eos=True, prompt_logprobs=3)
    for out in llm.generate([{"prompt_token_ids": prompt}] * 3, params, use_tqdm=False):
        assert_prompt_logprobs_match_hf(tiny_llama.hf_model, prompt, out)  # every position once, not n times
        for pos in range(1, len(prompt)):  # and the top 3 of each, with their ranks
            for rank, (token, value) in enumerate(zip(top.indices[pos - 1].tolist(), top.values[pos - 1].tolist()), 1):
                assert out.prompt_logprobs[pos][token].logprob == pytest.approx(value, abs=1e-4)
                assert token == prompt[pos] or out.prompt_logprobs[pos][token].rank == rank
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert_no_leak(llm)


# --- text, through a real sentencepiece (Llama 2 style) tokenizer ---


def test_output_text_reads_as_it_does_after_the_prompt(sentencepiece_llama):
    llm = LLM(str(sentencepiece_llama), dtype="float32", block_size=4)
    tokenizer = llm.get_tokenizer()
    texts = ["Once upon a time", "The quick brown fox", "Hello world! The robot said", "über 世界"]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    for out in llm.generate(texts, params, use_tqdm=False):
        prompt, completion = out.prompt_token_ids, out.outputs[0]
        head = tokenizer.decode(prompt, skip_special_tokens=True)
        full = tokenizer.decode(prompt + completion.token_ids, skip_special_tokens=True)
        assert completion.text == full[len(head) :]
        assert out.prompt + completion.text == full  # what `echo` sends
    llm.shutdown()


def test_allowed_token_ids_and_bad_words_shape_the_output(sentencepiece_llama):
    llm = LLM(str(sentencepiece_llama), dtype="float32", block_size=4)
    tokenizer = llm.get_tokenizer()
    free = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    allowed = sorted(set(free.token_ids[1:]) - {free.token_ids[0]})  # not the first token the model would pick
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, allowed_token_ids=allowed),
                       use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed) and out.token_ids[0] != free.token_ids[0]
    word = tokenizer.decode(free.token_ids[:2]).strip()  # the model's own first word(s): it wants to say them
    banned = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word])
    out = llm.generate("Once upon a time", banned, use_tqdm=False)[0].outputs[0]
    for sequence in (tokenizer.encode(word, add_special_tokens=False),
                     tokenizer.encode(" " + word, add_special_tokens=False)):
        assert not any(out.token_ids[i : i + len(sequence)] == sequence for i in range(len(out.token_ids)))
    llm.shutdown()
