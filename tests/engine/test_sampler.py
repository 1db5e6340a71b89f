"""The sampler against independent computations: argmax, numpy filters, HF penalties, log_softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmplug.core.params import SamplingParams
from llmplug.engine.sampler import (
    Sampler,
    apply_token_bitmask,
    argmax,
    compute_prompt_logprobs,
    gather_logprobs,
    greedy,
    inverse_cdf_sample,
    top_k,
)
from llmplug.engine.sampling_state import SamplingState, step_seed
from llmplug.layers.kernels.native import KERNELS_ENV

V = 300  # not a multiple of the sampler's block (128) nor of 32, to cover the short tails


def make_state(params: list[SamplingParams], vocab: int = V, prompts=None, outputs=None, eos=None):
    """A SamplingState holding one request per params, ids r0, r1, ..."""
    state = SamplingState(vocab)
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [1, 2, 3]
        output = outputs[i] if outputs else []
        state.add_request(f"r{i}", p, prompt, output, eos_token_ids=() if eos is None else (eos,))
    return state, [f"r{i}" for i in range(len(params))]


def sample(params: list[SamplingParams], logits: torch.Tensor, **kw) -> torch.Tensor:
    """Sampled ids of one step for a fresh batch."""
    state, ids = make_state(params, logits.shape[1], **kw)
    return Sampler()(logits.clone(), state.metadata(ids)).sampled_token_ids


def frequencies(params: SamplingParams, logits_row: torch.Tensor, n: int = 20000) -> np.ndarray:
    """Empirical distribution of n draws from one row (n identical requests, one step)."""
    torch.manual_seed(1234)
    tokens = sample([params] * n, logits_row.expand(n, -1))
    return np.bincount(tokens.numpy(), minlength=logits_row.shape[0]) / n


def softmax_np(x: np.ndarray) -> np.ndarray:
    """Numerically stable softmax in float64."""
    e = np.exp(x - x.max())
    return e / e.sum()


def assert_same_distribution(freq: np.ndarray, expected: np.ndarray, n: int = 20000) -> None:
    """No draw outside the support; each frequency within 5 sigma (plus 3 draws, for rare tokens) of its probability."""
    assert freq[expected == 0].sum() == 0.0
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 3 / n), np.abs(freq - expected).max()


@pytest.fixture
def row() -> torch.Tensor:
    """One logits row [V] with a spread that makes every filter bite."""
    torch.manual_seed(0)
    return torch.randn(V) * 2.0


# --- greedy ---


@pytest.mark.parametrize("vocab", [V, 49152, 257])
def test_greedy_is_argmax(vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(8, vocab)
    assert torch.equal(sample([SamplingParams(temperature=0.0)] * 8, logits), logits.argmax(-1))


def test_argmax_ties_pick_the_first_index():
    logits = torch.zeros(3, V)
    logits[0, [5, 200]] = 1.0
    logits[1, [299, 298]] = 2.0
    assert argmax(logits).tolist() == [5, 298, 0]


@pytest.mark.parametrize("kernels", ["auto", "0"], ids=["cpu-kernel", "torch"])
def test_greedy_takes_the_first_maximum_and_marks_a_nan_row(monkeypatch, kernels):
    monkeypatch.setenv(KERNELS_ENV, kernels)
    wide = torch.randn(6, V + 40)
    logits = wide[:, :V]  # rows apart in memory, as a slice of a wider buffer
    logits[0] = 0.0
    logits[0, [5, 200]] = 1.0
    logits[1, [299, 298]] = 50.0  # a tie: the first index wins
    logits[3, 7] = float("nan")
    logits[4] = float("-inf")
    logits[5, 123] = float("inf")
    tokens, top = greedy(logits)
    assert tokens[[0, 1, 2, 4, 5]].tolist() == [5, 298, int(logits[2].argmax()), 0, 123]
    assert 0 <= int(tokens[3]) < V  # junk, but in range
    assert torch.equal(top[[0, 1, 2]], logits[[0, 1, 2]].amax(-1)) and top[3].isnan()
    assert top[4] == float("-inf") and top[5] == float("inf")


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    torch.manual_seed(1)
    logits = torch.randn(16, V)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_p=0.9) for i in range(16)]
    out = sample(params, logits)
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))


# --- random sampling against numpy ---


def test_temperature_samples_the_softmax_of_scaled_logits(row):
    expected = softmax_np(row.double().numpy() / 0.7)
    assert_same_distribution(frequencies(SamplingParams(temperature=0.7), row), expected)


def test_top_k_keeps_only_the_k_most_likely(row):
    probs = softmax_np(row.double().numpy() / 0.9)
    keep = np.argsort(-probs)[:10]
    expected = np.zeros(V)
    expected[keep] = probs[keep] / probs[keep].sum()
    assert_same_distribution(frequencies(SamplingParams(temperature=0.9, top_k=10), row), expected)


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most likely tokens whose mass reaches top_p (numpy reference)."""
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    return order[: np.searchsorted(cumulative, top_p) + 1]


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_top_p_samples_the_renormalized_nucleus(row, top_p):
    probs = softmax_np(row.double().numpy() / 0.8)
    keep = nucleus(probs, top_p)
    expected = np.zeros(V)
    expected[keep] = probs[keep] / probs[keep].sum()
    assert_same_distribution(frequencies(SamplingParams(temperature=0.8, top_p=top_p), row), expected)


def test_min_p_drops_tokens_below_the_fraction_of_the_top(row):
    probs = softmax_np(row.double().numpy())
    expected = np.where(probs >= 0.05 * probs.max(), probs, 0.0)
    expected /= expected.sum()
    assert_same_distribution(frequencies(SamplingParams(min_p=0.05), row), expected)


def test_top_k_then_top_p_then_min_p(row):
    probs = softmax_np(row.double().numpy() / 1.3)
    order = np.argsort(-probs)
    top_k = np.zeros(V)
    top_k[order[:40]] = probs[order[:40]]
    top_k /= top_k.sum()
    keep = nucleus(top_k, 0.9)
    expected = np.zeros(V)
    expected[keep] = top_k[keep]
    expected = np.where(expected >= 0.1 * expected.max(), expected, 0.0)
    expected /= expected.sum()
    params = SamplingParams(temperature=1.3, top_k=40, top_p=0.9, min_p=0.1)
    assert_same_distribution(frequencies(params, row), expected)


def test_top_p_keeps_every_token_tied_at_the_boundary():
    logits = torch.full((V,), -30.0)
    logits[:4] = 0.0  # four equal tokens: any top_p below 1 that needs one of them needs them all
    freq = frequencies(SamplingParams(top_p=0.3), logits, n=4000)
    assert set(np.nonzero(freq)[0]) == {0, 1, 2, 3}


def test_inverse_cdf_never_picks_a_zero_weight_token():
    weights = torch.zeros(5, 1000)
    weights[0, 999] = 1.0
    weights[1, [0, 500]] = 1e-30
    weights[2, 127:129] = 3.0  # across a block boundary
    weights[3] = torch.rand(1000) * (torch.rand(1000) > 0.9)
    weights[4, 640] = 2.0
    for uniforms in (torch.zeros(5), torch.full((5,), 1.0 - 2**-24), torch.rand(5)):
        tokens, _ = inverse_cdf_sample(weights, uniforms)
        assert bool((weights.gather(1, tokens[:, None]) > 0).all())


# --- seeds ---


def test_seeded_rows_are_the_same_alone_and_in_a_mixed_batch():
    torch.manual_seed(3)
    logits = torch.randn(16, V)
    seeded = {2: SamplingParams(seed=7, top_p=0.9), 9: SamplingParams(seed=11, temperature=0.5, top_k=20, min_p=0.01)}
    batch = [seeded.get(i, SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0)) for i in range(16)]
    state, ids = make_state(batch)
    alone = {i: make_state([p]) for i, p in seeded.items()}
    sampler = Sampler()
    for _ in range(5):  # several steps: the generators follow the output position
        step = torch.randn(16, V) + logits
        out = sampler(step.clone(), state.metadata(ids)).sampled_token_ids
        for i, (s, one) in alone.items():
            solo = Sampler()(step[i : i + 1].clone(), s.metadata(one)).sampled_token_ids
            assert int(out[i]) == int(solo[0])
            s.append_output(one[0], [int(solo[0])])
        for i, req_id in enumerate(ids):
            state.append_output(req_id, [int(out[i])])


def test_seeded_request_resumes_identically_after_preemption(row):
    params = SamplingParams(seed=5)
    state, ids = make_state([params])
    first = [int(Sampler()(row[None].clone(), state.metadata(ids)).sampled_token_ids[0])]
    state.append_output("r0", first)
    second = int(Sampler()(row[None].clone(), state.metadata(ids)).sampled_token_ids[0])
    state.remove_request("r0")
    state.add_request("r0", params, [1, 2, 3], first)
    assert int(Sampler()(row[None].clone(), state.metadata(ids)).sampled_token_ids[0]) == second


def test_step_seed_differs_by_seed_and_position():
    seeds = {step_seed(s, p) for s in range(20) for p in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)


# --- shaping the distribution ---


def shaped_logits(params, logits, prompts=None, outputs=None, eos=None, bitmask=None) -> torch.Tensor:
    """The logits after processors/bias/penalties, recovered from the logprobs of a greedy step."""
    state, ids = make_state(params, logits.shape[1], prompts=prompts, outputs=outputs, eos=eos)
    md = state.metadata(ids)
    md.max_num_logprobs = logits.shape[1]  # all tokens: top-V logprobs give the whole shaped row
    lp = Sampler()(logits.clone(), md, bitmask).logprobs
    out = torch.full_like(logits, float("nan"))
    out.scatter_(1, lp.logprob_token_ids[:, 1:], lp.logprobs[:, 1:])
    return out


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(4)
    logits = torch.randn(2, V) * 3
    prompts, outputs = [[5, 6, 7, 5], [100, 101]], [[7, 8, 8], [299]]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r) for r in (1.3, 0.7)]
    got = shaped_logits(params, logits, prompts, outputs)
    for i, p in enumerate(params):
        hf = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        expected = hf(torch.tensor([prompts[i] + outputs[i]]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], torch.log_softmax(expected, -1))


def test_frequency_and_presence_penalties_follow_the_openai_formula():
    torch.manual_seed(5)
    logits = torch.randn(1, V)
    output = [3, 3, 3, 9, 40]
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)]
    got = shaped_logits(params, logits, prompts=[[9, 77]], outputs=[output])
    counts = torch.bincount(torch.tensor(output), minlength=V).float()
    expected = logits[0] - 0.5 * counts - 0.25 * (counts > 0).float()
    torch.testing.assert_close(got[0], torch.log_softmax(expected, -1))


def test_penalties_count_tokens_appended_across_steps():
    torch.manual_seed(6)
    logits = torch.randn(2, V)
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=1.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0),
    ]
    state, ids = make_state(params, prompts=[[4], [4]])
    sampler = Sampler()
    sampler(logits.clone(), state.metadata(ids))
    state.append_output("r0", [10])
    state.append_output("r1", [11])
    sampler(logits.clone(), state.metadata(ids))
    state.append_output("r0", [10])
    md = state.metadata(ids)
    md.max_num_logprobs = V
    lp = sampler(logits.clone(), md).logprobs
    got = torch.empty(V).scatter_(0, lp.logprob_token_ids[0, 1:], lp.logprobs[0, 1:])
    from transformers import RepetitionPenaltyLogitsProcessor

    ref = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([[4, 10, 10]]), logits[:1].clone())[0]
    ref[10] -= 2.0
    torch.testing.assert_close(got, torch.log_softmax(ref, -1))


def test_logit_bias_is_added():
    torch.manual_seed(7)
    logits = torch.randn(2, V)
    params = [SamplingParams(temperature=0.0, logit_bias={5: 3.0, 17: -2.5}), SamplingParams(temperature=0.0)]
    got = shaped_logits(params, logits)
    expected = logits.clone()
    expected[0, 5] += 3.0
    expected[0, 17] -= 2.5
    torch.testing.assert_close(got, torch.log_softmax(expected, -1))


def test_logit_bias_can_force_a_token():
    logits = torch.zeros(4, V)
    assert sample([SamplingParams(logit_bias={42: 100.0})] * 4, logits).tolist() == [42] * 4


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, [2, 7, 8]] = 50.0  # eos 2 and stop ids 7, 8 dominate
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7, 8])
    state, ids = make_state([params], eos=2)
    sampler = Sampler()
    for _ in range(2):
        token = int(sampler(logits.clone(), state.metadata(ids)).sampled_token_ids[0])
        assert token not in (2, 7, 8)
        state.append_output("r0", [token])
    assert int(sampler(logits.clone(), state.metadata(ids)).sampled_token_ids[0]) in (2, 7, 8)


def test_min_tokens_leaves_eos_alone_with_ignore_eos():
    logits = torch.zeros(1, V)
    logits[0, 2] = 50.0
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sample([params], logits, eos=2).tolist() == [2]


def test_logits_processors_see_output_ids_and_change_their_row():
    seen = []

    def ban_last(output_token_ids, row):
        seen.append(list(output_token_ids))
        row[output_token_ids[-1]] = float("-inf")
        return row

    logits = torch.zeros(2, V)
    logits[:, 9] = 10.0
    params = [SamplingParams(temperature=0.0, logits_processors=[ban_last]), SamplingParams(temperature=0.0)]
    out = sample(params, logits, outputs=[[9], [9]])
    assert seen == [[9]] and int(out[0]) != 9 and int(out[1]) == 9


# --- bitmask ---


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Pack a [B, V] bool allowed-set into [B, ceil(V/32)] int32, bit j of word i = token 32 i + j."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)  # [B, W] as unsigned
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_apply_token_bitmask_matches_masked_fill():
    torch.manual_seed(8)
    logits = torch.randn(4, V)
    allowed = torch.rand(4, V) > 0.7
    allowed[2] = True  # an unconstrained row
    allowed[3, V - 1] = True  # the last token, in the short last word
    expected = logits.masked_fill(~allowed, float("-inf"))
    got = logits.clone()
    apply_token_bitmask(got, pack_bitmask(allowed))
    assert torch.equal(got, expected)


def test_apply_token_bitmask_forbids_tokens_past_its_width():
    logits = torch.zeros(2, 100)
    allowed = torch.ones(2, 64, dtype=torch.bool)
    allowed[0, 5] = False  # row 0 is constrained; row 1 allows every token the bitmask covers
    apply_token_bitmask(logits, pack_bitmask(allowed))
    assert torch.isneginf(logits[0]).nonzero().squeeze(1).tolist() == [5, *range(64, 100)]
    assert not torch.isneginf(logits[1]).any()  # all ones: unconstrained, left alone


def test_bitmask_constrains_sampling():
    torch.manual_seed(9)
    logits = torch.randn(64, V)
    allowed = torch.zeros(64, V, dtype=torch.bool)
    allowed[:, [3, 64, 299]] = True
    state, ids = make_state([SamplingParams(temperature=1.5)] * 64)
    out = Sampler()(logits, state.metadata(ids), pack_bitmask(allowed)).sampled_token_ids
    assert set(out.tolist()) <= {3, 64, 299}


# --- logprobs ---


def test_logprobs_are_log_softmax_of_the_shaped_logits_with_ranks():
    torch.manual_seed(10)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.8, logprobs=5, logit_bias={1: 2.0}) for _ in range(6)]
    params[0] = SamplingParams(temperature=0.0, logprobs=3)
    state, ids = make_state(params)
    out = Sampler()(logits.clone(), state.metadata(ids))
    lp = out.logprobs
    shaped = logits.clone()
    shaped[1:, 1] += 2.0
    reference = torch.log_softmax(shaped, -1)
    assert lp.logprob_token_ids.shape == (6, 6)
    assert torch.equal(lp.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(lp.logprobs, reference.gather(1, lp.logprob_token_ids))
    top = reference.topk(5, dim=-1)
    assert torch.equal(lp.logprob_token_ids[:, 1:], top.indices)
    order = reference.argsort(dim=-1, descending=True)
    expected_ranks = [order[i].tolist().index(int(t)) + 1 for i, t in enumerate(out.sampled_token_ids)]
    assert lp.selected_token_ranks.tolist() == expected_ranks
    assert lp.selected_token_ranks[0] == 1  # the greedy row took the top token


@pytest.mark.parametrize("vocab, k", [(49152, 20), (1000, 1), (1000, 0), (4000, 7)])
def test_two_level_top_k_matches_torch_topk(vocab, k):
    torch.manual_seed(vocab + k)
    x = torch.randn(6, vocab)
    x[0, -3:] = 100.0  # winners in the short last block (1000 and 4000 are not multiples of 128)
    x[1, :] = float("-inf")
    x[1, [7, 900]] = 0.0  # fewer finite values than k: the rest are -inf
    values, indices = top_k(x, k)
    expected = x.topk(k, dim=-1)
    assert torch.equal(values, expected.values)
    assert torch.equal(x.gather(1, indices), expected.values)
    assert torch.equal(indices[2:], expected.indices[2:])


def test_ranks_count_ties_and_skip_minus_infinity():
    lp = torch.tensor([[-1.0, -2.0, -1.0, float("-inf"), -0.5]])
    out = gather_logprobs(lp.clone(), torch.tensor([2]), 2)
    assert out.selected_token_ranks.tolist() == [3]  # -0.5, -1.0 and itself (tied) are >= -1.0
    assert out.logprob_token_ids[0, 1:].tolist()[0] == 4


def test_no_logprobs_when_nobody_asks():
    out = Sampler()(torch.randn(2, V), make_state([SamplingParams()] * 2)[0].metadata(["r0", "r1"]))
    assert out.logprobs is None


def test_prompt_logprobs():
    torch.manual_seed(11)
    logits = torch.randn(5, V)
    targets = torch.tensor([4, 8, 15, 16, 23])
    lp = compute_prompt_logprobs(logits, targets, 2)
    reference = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp.logprobs[:, 0], reference[torch.arange(5), targets])
    assert torch.equal(lp.logprob_token_ids[:, 1:], reference.topk(2).indices)
    ranks = [int((reference[i] >= reference[i, t]).sum()) for i, t in enumerate(targets)]
    assert lp.selected_token_ranks.tolist() == ranks
    assert lp.tolists().logprob_token_ids[0][0] == 4
    assert lp.row(1).logprob_token_ids == [lp.logprob_token_ids[1].tolist()]


# --- state ---


def test_metadata_is_cached_until_the_batch_changes():
    state, ids = make_state([SamplingParams(), SamplingParams(temperature=0.0)])
    first = state.metadata(ids)
    assert state.metadata(ids) is first
    assert state.metadata(ids[::-1]) is not first
    state.add_request("r2", SamplingParams(), [1], [])
    assert state.metadata(ids[::-1]) is state.metadata(ids[::-1])


def test_features_nobody_uses_are_absent_from_the_metadata():
    md = make_state([SamplingParams(temperature=0.0)] * 3)[0].metadata(["r0", "r1", "r2"])
    assert md.random is None and md.penalties is None and md.logit_bias is None
    assert md.banned_tokens is None and md.allowed_tokens is None and md.max_num_logprobs is None and not md.logits_processors
    md = make_state([SamplingParams(temperature=0.9)] * 2)[0].metadata(["r0", "r1"])
    assert md.all_random and md.random.top_k is None and md.random.top_p is None and md.random.min_p is None


def test_top_k_larger_than_the_allowed_set_keeps_the_allowed_set():
    logits = torch.randn(200, V)
    allowed = torch.zeros(200, V, dtype=torch.bool)
    allowed[:, [10, 20, 30]] = True
    state, ids = make_state([SamplingParams(top_k=50)] * 200)
    out = Sampler()(logits, state.metadata(ids), pack_bitmask(allowed)).sampled_token_ids
    assert set(out.tolist()) == {10, 20, 30}


def test_penalties_work_without_a_known_vocabulary_size():
    state = SamplingState()  # the vocabulary is then only known from the logits
    state.add_request("r0", SamplingParams(temperature=0.0, presence_penalty=2.0), [5000], [])
    logits = torch.zeros(1, 6000)
    logits[0, [5000, 5001]] = torch.tensor([1.0, 0.5])
    sampler = Sampler()
    assert int(sampler(logits.clone(), state.metadata(["r0"])).sampled_token_ids[0]) == 5000
    state.append_output("r0", [5000])  # now an output token too: the presence penalty applies
    assert int(sampler(logits.clone(), state.metadata(["r0"])).sampled_token_ids[0]) == 5001


def test_engine_wide_processors_run_on_every_row_after_penalties():
    calls = []

    def forbid_zero(output_token_ids, row):
        calls.append((list(output_token_ids), float(row[0])))
        row[0] = float("-inf")
        return row

    logits = torch.zeros(2, V)
    logits[:, 0] = 5.0
    params = [SamplingParams(temperature=0.0, logit_bias={0: 1.0}), SamplingParams(temperature=0.0)]
    state, ids = make_state(params, outputs=[[4], []])
    out = Sampler(logits_processors=[forbid_zero])(logits, state.metadata(ids)).sampled_token_ids
    assert calls == [([4], 6.0), ([], 5.0)] and 0 not in out.tolist()


# --- rows that cannot be sampled ---


BATCH_OF_EVERY_KIND = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, seed=2, top_p=0.7),
    SamplingParams(temperature=1.1, seed=3, top_k=20),
    SamplingParams(temperature=0.9, seed=4, min_p=0.05),
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=1.0, seed=5, top_k=30, top_p=0.8, min_p=0.01),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
]


@pytest.mark.parametrize("poison", ["nan", "+inf", "all -inf"])
@pytest.mark.parametrize("row_index", [0, 2, 6])
def test_a_non_finite_row_is_flagged_and_the_others_sample_as_in_a_clean_batch(poison, row_index):
    torch.manual_seed(0)
    logits = torch.randn(8, V) * 2.0
    clean_state, ids = make_state(BATCH_OF_EVERY_KIND)
    clean = Sampler()(logits.clone(), clean_state.metadata(ids))
    bad = logits.clone()
    if poison == "all -inf":
        bad[row_index] = float("-inf")
    else:
        bad[row_index, 17] = float(poison.lstrip("+"))
    state, ids = make_state(BATCH_OF_EVERY_KIND)
    out = Sampler()(bad, state.metadata(ids))
    assert out.unsampleable.tolist() == [i == row_index for i in range(8)]
    others = [i for i in range(8) if i != row_index]
    assert torch.equal(out.sampled_token_ids[others], clean.sampled_token_ids[others])
    assert 0 <= int(out.sampled_token_ids[row_index]) < V  # junk, but never out of range
    assert torch.equal(out.logprobs.logprobs[others], clean.logprobs.logprobs[others])


def test_a_clean_batch_has_no_unsampleable_row():
    torch.manual_seed(1)
    state, ids = make_state(BATCH_OF_EVERY_KIND)
    assert not Sampler()(torch.randn(8, V), state.metadata(ids)).unsampleable.any()


def test_allowed_token_ids_leave_only_those_tokens():
    out = shaped_logits([SamplingParams(allowed_token_ids=[3, V - 1]), SamplingParams()], torch.zeros(2, V))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, V - 1]
    assert torch.isfinite(out[1]).all()


def test_bad_words_forbid_a_word_s_last_token_once_the_rest_is_generated():
    params = SamplingParams(temperature=0.0)
    params.bad_words_token_ids = [[7], [5, 6], [1, 2, 3]]
    out = shaped_logits([params] * 3, torch.zeros(3, V), outputs=[[], [9, 5], [1, 2]])
    banned = [set(torch.isinf(row).nonzero().flatten().tolist()) for row in out]
    assert banned == [{7}, {7, 6}, {7, 3}]
