"""Speculative decoding (n-gram prompt lookup): greedy output equals plain decoding, sampled output follows
plain sampling's distribution (a chi-square test that a broken rejection rule fails), metrics, refusals."""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections import Counter

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ConfigError, InvalidRequestError
from llmplug.core.params import GuidedDecodingParams
from llmplug.engine.spec_decode.rejection_sampler import RejectionSampler, sampling_distribution
from tests.models.tiny_models import ARCHS, make_tiny

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# repetitive prompts: the n-gram lookup finds their tails earlier and proposes what followed
PROMPTS = [[5, 6, 7, 8] * 4 + [5, 6], [1, 2, 3] * 3, [9, 10, 11, 12, 13, 9, 10, 11], list(range(30, 60)) + [30, 31]]
VARIANTS = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "preemption": {"num_gpu_blocks_override": 20, "max_num_seqs": 4},
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict:
    return {}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


def make_llm(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=4, **kwargs)


def generate(llm: LLM, params, prompts=PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_no_leak(llm: LLM) -> None:
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert not llm.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# every architecture plainly; the scheduler's other paths on two of them
CASES = [(arch, "plain") for arch in sorted(ARCHS)] + [
    ("llama", "chunked_prefill"), ("llama", "preemption"), ("qwen3", "chunked_prefill"), ("qwen3", "preemption"),
]


@pytest.mark.parametrize("arch,variant", CASES)
def test_greedy_output_equals_plain_decoding(arch, variant, tiny_models, tmp_path_factory):
    tiny = tiny_models.get(arch) or tiny_models.setdefault(arch, make_tiny(arch, tmp_path_factory.mktemp(arch)))
    expected = generate(make_llm(tiny.path), GREEDY)
    llm = make_llm(tiny.path, speculative_config=NGRAM, **VARIANTS[variant])
    assert generate(llm, GREEDY) == expected
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0  # drafts were accepted, not only proposed
    assert 0 < stats["spec_decode_acceptance_rate"] <= 1
    assert stats["spec_decode_mean_accepted_length"] == pytest.approx(
        1 + stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_drafts"])
    # acceptance stops at the first rejection: each position accepts no more often than the one before it
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == NGRAM["num_speculative_tokens"] and sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True) and per_pos[0] <= stats["spec_decode_num_drafts"]
    if variant == "preemption":
        assert stats["num_preemptions"] > 0
    assert_no_leak(llm)


@pytest.mark.slow
def test_greedy_output_of_the_default_model_equals_plain_decoding():
    prompt = ("Rename x to count in this code:\ndef f(x):\n    x = x + 1\n    return x * x\n"
              "Answer:\ndef f(count):\n")
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = LLM(max_model_len=256, dtype="float32")
    expected = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    del plain
    gc.collect()  # the engine's reference cycles would keep its model beside the next one's
    llm = LLM(max_model_len=256, dtype="float32", speculative_config=NGRAM)
    got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("draft_arch,variant", [("llama", "plain"), ("qwen2", "plain"), ("qwen2", "chunked_prefill"),
                                               ("qwen2", "preemption")])
def test_greedy_output_with_a_draft_model_equals_plain_decoding(draft_arch, variant, tiny_models, tmp_path_factory):
    """A draft model of another architecture over the same vocabulary (or the target itself: every draft accepted)."""
    target = tiny_models.get("llama") or tiny_models.setdefault("llama", make_tiny("llama", tmp_path_factory.mktemp("llama")))
    draft = target if draft_arch == "llama" else make_tiny(draft_arch, tmp_path_factory.mktemp(f"draft_{draft_arch}"),
                                                           seed=1)
    expected = generate(make_llm(target.path), GREEDY)
    config = {"method": "draft_model", "model": str(draft.path), "num_speculative_tokens": 3}
    llm = make_llm(target.path, speculative_config=config, **VARIANTS[variant])
    assert generate(llm, GREEDY) == expected
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if draft is target:
        assert stats["spec_decode_acceptance_rate"] > 0.95  # the target drafting for itself (float rounding aside)
    assert_no_leak(llm)
    llm.shutdown()


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path_factory):
    other = make_tiny("qwen2", tmp_path_factory.mktemp("draft_vocab"), overrides={"vocab_size": 300})
    config = {"method": "draft_model", "model": str(other.path), "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="vocabulary"):
        make_llm(tiny_llama.path, speculative_config=config)


# --- sampled requests: the distribution of the first three tokens ------------------------------------

NUM_SAMPLES = 2000
TEMPERATURE = 0.2  # the tiny random model's distribution is nearly flat at 1; here a few tokens hold most of it


@pytest.fixture(scope="module")
def sampling_prompt(tiny_llama) -> list[int]:
    """A prompt the model would have written itself (its greedy continuation of a short one): its tokens recur,
    so the n-gram lookup finds most sampled tokens in it and proposes what followed them."""
    ids = torch.tensor([[7, 3, 7, 3, 7, 3, 7]])
    with torch.inference_mode():
        out = tiny_llama.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=45,
                                           do_sample=False, pad_token_id=0)
    return out[0].tolist()


def first_tokens(llm: LLM, prompt: list[int], first_seed: int) -> list[tuple[int, ...]]:
    """The (t1, t2, t3) of NUM_SAMPLES seeded samples."""
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True, seed=first_seed + i)
              for i in range(NUM_SAMPLES)]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * NUM_SAMPLES, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outputs]


def p_values(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> list[float]:
    """Chi-square p-values that `a` and `b` share the distribution of each of the three tokens and of the triple."""
    positions = [Counter(t[i] for t in a) for i in range(3)], [Counter(t[i] for t in b) for i in range(3)]
    return [chi_square_p_value(x, y) for x, y in zip(*positions)] + [chi_square_p_value(Counter(a), Counter(b))]


def chi_square_p_value(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """The p-value of a chi-square test that samples `a` and `b` come from one distribution (rare outcomes pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b))
    common = [k for k in keys if (a[k] + b[k]) * min(na, nb) / (na + nb) >= min_expected]
    rows = [(a[k], b[k]) for k in common]
    rows.append((na - sum(r[0] for r in rows), nb - sum(r[1] for r in rows)))  # the pooled rare outcomes
    rows = [r for r in rows if sum(r)]
    table = torch.tensor(rows, dtype=torch.float64)  # [outcomes, 2]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


class ResidualIncludesTheDraft(RejectionSampler):
    """A subtly broken rule: after a rejection it draws from p itself, the rejected draft's share included."""

    @staticmethod
    def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
        return p


class AcceptEveryDraft(RejectionSampler):
    """A plainly broken rule: every draft token is accepted."""

    @staticmethod
    def accept_probability(p: torch.Tensor, q: torch.Tensor | None, token: int) -> float:
        return 1.0


def runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.fixture(scope="module")
def plain_samples(tiny_llama, sampling_prompt) -> list[tuple[int, ...]]:
    return first_tokens(make_llm(tiny_llama.path, max_num_seqs=256), sampling_prompt, first_seed=0)


def test_sampled_first_tokens_follow_plain_sampling(tiny_llama, sampling_prompt, plain_samples):
    llm = make_llm(tiny_llama.path, max_num_seqs=256, speculative_config=NGRAM)
    # seeds of their own: the two samples are independent
    spec_samples = first_tokens(llm, sampling_prompt, first_seed=100_000)
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] >= NUM_SAMPLES // 2  # many second and third tokens were drafts
    assert min(p_values(plain_samples, spec_samples)) > 0.01 / 4  # four tests at 1 %


@pytest.mark.slow
@pytest.mark.parametrize("broken,threshold", [(AcceptEveryDraft, 1e-9), (ResidualIncludesTheDraft, 1e-3)])
def test_the_chi_square_test_catches_a_broken_rejection_rule(tiny_llama, sampling_prompt, plain_samples, broken,
                                                             threshold):
    llm = make_llm(tiny_llama.path, max_num_seqs=256, speculative_config=NGRAM)
    runner(llm).verifier.rejection_sampler = broken()
    # the same seeds as the sound sampler's run, whose p-values are all above 0.0025
    samples = first_tokens(llm, sampling_prompt, first_seed=100_000)
    assert min(p_values(plain_samples, samples)) < threshold


@pytest.mark.parametrize("top_p", [0.3, 0.9, 1.0])
def test_the_verified_distribution_is_temperature_then_the_top_p_nucleus(top_p):
    """Against transformers' TopPLogitsWarper: the distribution the rejection sampler verifies against."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    expected = torch.softmax(TopPLogitsWarper(top_p)(None, logits / 0.7), dim=-1)
    torch.testing.assert_close(sampling_distribution(logits, 0.7, top_p), expected)


@pytest.fixture(scope="module")
def near_draft(tiny_llama, tmp_path_factory):
    """A draft model close to the target: the target with its logits halved, so q is a flatter p. Drafts are
    often accepted, not always, and both the acceptance p / q and the residual max(0, p - q) shape the output."""
    path = tmp_path_factory.mktemp("near_draft")
    draft = copy.deepcopy(tiny_llama.hf_model)
    with torch.no_grad():
        draft.lm_head.weight.mul_(0.5)
    draft.save_pretrained(path)
    return path


def draft_model_config(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}


@pytest.mark.slow
def test_sampled_drafts_follow_plain_sampling(tiny_llama, sampling_prompt, plain_samples, near_draft):
    """Drafts sampled from the draft model's distribution, verified with p / q: the target's distribution holds."""
    llm = make_llm(tiny_llama.path, max_num_seqs=256, speculative_config=draft_model_config(near_draft))
    samples = first_tokens(llm, sampling_prompt, first_seed=100_000)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert min(p_values(plain_samples, samples)) > 0.01 / 4
    llm.shutdown()


def test_sampled_drafts_are_accepted_more_often_than_greedy_ones(tiny_llama, sampling_prompt, near_draft):
    llm = make_llm(tiny_llama.path, max_num_seqs=256, speculative_config=draft_model_config(near_draft))
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=i) for i in range(32)]
    prompts = [{"prompt_token_ids": sampling_prompt}] * len(params)
    llm.generate(prompts, params, use_tqdm=False)
    sampled = llm.stats()
    speculator = llm.llm_engine.engine_core.scheduler.speculator
    speculator.proposer = GreedyDrafts(speculator.proposer)
    llm.generate(prompts, params, use_tqdm=False)
    assert sampled["spec_decode_acceptance_rate"] > acceptance_since(llm.stats(), sampled) + 0.05
    llm.shutdown()


class GreedyDrafts:
    """The draft model proposing greedily for every request (certain drafts: one-hot q), as before sampled drafts."""

    def __init__(self, proposer):
        self.proposer = proposer

    def propose(self, requests):
        return self.proposer.propose([dataclasses.replace(r, params=SamplingParams(temperature=0.0))
                                      for r in requests])

    def shutdown(self):
        self.proposer.shutdown()


def acceptance_since(now: dict, before: dict) -> float:
    accepted = now["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return accepted / (now["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"])


@pytest.mark.slow
def test_the_chi_square_test_catches_a_residual_that_ignores_the_draft_distribution(
        tiny_llama, sampling_prompt, plain_samples, near_draft):
    """(Accepting with p(d) as if the sampled draft were certain is no such twin: that rule is exact for
    drafts chosen in any way independent of the target's draws, only less often accepted.)"""
    llm = make_llm(tiny_llama.path, max_num_seqs=256, speculative_config=draft_model_config(near_draft))
    runner(llm).verifier.rejection_sampler = ResidualIncludesTheDraft()
    samples = first_tokens(llm, sampling_prompt, first_seed=100_000)  # the sound sampler's seeds
    assert min(p_values(plain_samples, samples)) < 1e-3  # 1.3e-9 at the time of writing
    llm.shutdown()


def test_seeded_sampled_requests_are_reproducible(tiny_llama):
    llm = make_llm(tiny_llama.path, speculative_config=NGRAM)
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=7)
    assert generate(llm, params) == generate(llm, params)
    assert_no_leak(llm)


# --- what is refused -----------------------------------------------------------------------------

def test_guided_decoding_is_refused_and_the_next_request_works(tiny_llama):
    llm = make_llm(tiny_llama.path, speculative_config=NGRAM)
    expected = generate(llm, GREEDY)
    guided = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(regex="[ab]+"))
    with pytest.raises(InvalidRequestError, match="speculative") as info:
        llm.generate({"prompt_token_ids": [1, 2]}, guided, use_tqdm=False)
    assert info.value.param == "guided_decoding"
    assert generate(llm, GREEDY) == expected
    assert_no_leak(llm)


def test_requests_that_cannot_speculate_decode_plainly_beside_those_that_do(tiny_llama):
    plain = make_llm(tiny_llama.path)
    llm = make_llm(tiny_llama.path, speculative_config=NGRAM)
    penalized = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3, logprobs=2)
    params = [GREEDY, penalized, GREEDY, penalized]
    got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    expected = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].cumulative_logprob for o in got[1::2]] == pytest.approx(
        [o.outputs[0].cumulative_logprob for o in expected[1::2]], abs=1e-4)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("config,field", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
])
def test_bad_speculative_configs_are_refused(tiny_llama, config, field):
    with pytest.raises(ConfigError, match=field):
        make_llm(tiny_llama.path, speculative_config=config)
