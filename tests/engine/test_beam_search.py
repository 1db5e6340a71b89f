"""LLM.beam_search against transformers' generate(num_beams=...) on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from llmplug import LLM, BeamSearchParams
from llmplug.core.errors import InvalidRequestError
from tests.models.tiny_models import make_tiny

MAX_TOKENS = 10
PROMPTS = [[5, 17, 99, 3], [200, 1, 45, 45, 45, 12, 7, 150, 33], [9]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same tiny Llama twice: without an end token, and with one that the model often ranks high."""
    plain = make_tiny("llama", tmp_path_factory.mktemp("beam_plain"))
    with torch.inference_mode():
        logits = plain.hf_model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    eos = int(logits.argsort(descending=True)[1])  # the runner-up after the first prompt: beams meet it early
    with_eos = make_tiny("llama", tmp_path_factory.mktemp("beam_eos"), overrides={"eos_token_id": eos})
    return plain, with_eos


def make_llm(tiny) -> LLM:
    return LLM(str(tiny.path), dtype="float32", skip_tokenizer_init=True, block_size=4, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def llms(models):
    return tuple(make_llm(m) for m in models)


def hf_beams(hf_model, prompt: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    """transformers' best sequences (generated tokens) and their scores, best first."""
    ids = torch.tensor([prompt])
    common = dict(attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens, do_sample=False,
                  pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    with torch.inference_mode():
        if params.beam_width == 1:  # transformers runs greedy decoding: its score is the summed logprob
            out = hf_model.generate(ids, **common)
            logprobs = hf_model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
            tokens = out.sequences[0, len(prompt):].tolist()
            return [(tokens, float(logprobs.sum()) / len(tokens) ** params.length_penalty)]
        out = hf_model.generate(ids, num_beams=params.beam_width, num_return_sequences=params.beam_width,
                                early_stopping=params.early_stopping, length_penalty=params.length_penalty, **common)
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    return [(out.sequences[i, len(prompt): len(prompt) + n].tolist(), float(out.sequences_scores[i]))
            for i, n in enumerate(lengths)]


def our_beams(llm: LLM, params: BeamSearchParams) -> list[list[tuple[list[int], float]]]:
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    result = []
    for prompt, output in zip(PROMPTS, outputs):
        assert len(output.sequences) == params.beam_width
        beams = []
        for seq in output.sequences:
            assert seq.tokens[: len(prompt)] == prompt  # vLLM's shape: the prompt leads every beam
            generated = seq.tokens[len(prompt):]
            assert len(seq.logprobs) == len(generated)
            assert seq.cum_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(seq.logprobs, generated)))
            beams.append((generated, seq.cum_logprob / len(generated) ** params.length_penalty))
        result.append(beams)
    return result


def assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("eos", [True, False], ids=["eos", "ignore_eos"])
@pytest.mark.parametrize("beam_width", [1, 2, 4])
@pytest.mark.parametrize("early_stopping,length_penalty", [(False, 1.0), (True, 0.5), ("never", 2.0), (False, -1.0)])
def test_beams_equal_transformers(models, llms, eos, beam_width, early_stopping, length_penalty):
    index = 1 if eos else 0
    params = BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS, early_stopping=early_stopping,
                              length_penalty=length_penalty, include_stop_str_in_output=True)
    ours = our_beams(llms[index], params)
    for prompt, beams in zip(PROMPTS, ours):
        expected = hf_beams(models[index].hf_model, prompt, params)
        assert [tokens for tokens, _ in beams] == [tokens for tokens, _ in expected]
        for (_, score), (_, hf_score) in zip(beams, expected):
            assert score == pytest.approx(hf_score, abs=1e-4)
    assert_no_leak(llms[index])


@pytest.mark.parametrize("include", [False, True])
def test_an_end_token_finishes_a_beam_and_is_left_out_unless_asked(models, llms, include):
    eos = models[1].hf_model.config.eos_token_id
    # a negative length penalty favours short beams: those the end token finished
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS, length_penalty=-1.0,
                              include_stop_str_in_output=include)
    outputs = llms[1].beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    stopped = [(prompt, s) for prompt, out in zip(PROMPTS, outputs) for s in out.sequences if s.finish_reason == "stop"]
    assert stopped, "the test's end token should finish some beam"
    for prompt, seq in stopped:
        generated = seq.tokens[len(prompt):]
        assert seq.stop_reason == eos and (generated[-1:] == [eos]) == include
        assert len(seq.logprobs) == len(generated) + (0 if include else 1)  # the end token's logprob counts


def test_beams_share_the_prompts_kv_blocks(llms):
    llm = llms[0]
    prompt = list(range(40, 80))  # 10 blocks of 4
    before = llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats
    params = BeamSearchParams(beam_width=4, max_tokens=6)
    llm.beam_search({"prompt_token_ids": prompt}, params)
    after = llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats
    num_requests = 1 + 4 * (params.max_tokens - 1)  # one for the prompt, then one per beam and step
    computed = (after.queries - before.queries) - (after.hits - before.hits)
    # the prompt is computed once; every later request computes at most its last block of 4 tokens
    assert computed <= len(prompt) + num_requests * 4
    assert_no_leak(llm)


@pytest.mark.parametrize("bad,param", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=2.0, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
])
def test_bad_params_are_refused_when_built(bad, param):
    with pytest.raises(InvalidRequestError, match=param) as info:
        BeamSearchParams(**bad)
    assert info.value.param == param


@pytest.mark.parametrize("prompts,params,param", [
    ([[1, 2, 3]], BeamSearchParams(beam_width=11, max_tokens=4), "beam_width"),  # 22 logprobs > max_logprobs
    ([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=300), "max_tokens"),  # past max_model_len 256
    ([[1, 2, 3], [999]], BeamSearchParams(beam_width=2, max_tokens=4), "prompt"),  # out of the vocabulary
])
def test_bad_requests_fail_before_queueing_and_the_next_search_works(llms, prompts, params, param):
    llm = llms[1]
    good = BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS)
    before = llm.beam_search({"prompt_token_ids": PROMPTS[0]}, good)
    with pytest.raises(InvalidRequestError) as info:
        llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert info.value.param == param
    assert_no_leak(llm)
    assert llm.beam_search({"prompt_token_ids": PROMPTS[0]}, good) == before
