"""Sliding-window attention end to end: a tiny Mistral (window 16 on every layer) and a tiny Qwen2
(`use_sliding_window`: a full layer, then a windowed one) match transformers on prompts longer than the
window — greedy tokens of batched decode identical to `generate`, and logits through batched prefill,
chunked prefill and a prefix-cache hit whose cached context is longer than the window; and the whole
engine (LLM) generates the same tokens as `generate` with chunked prefill, preemption and prefix hits."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.attention import attention_layers

from llmplug.testing.paged import PagedHarness
from .test_llama_parity import ATOL, hf_logits, prompts
from .tiny_models import TinyModel, make_tiny

WINDOW = 16
WINDOWED = {
    "mistral": ({"sliding_window": WINDOW}, [WINDOW, WINDOW]),
    "qwen2": ({"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}, [None, WINDOW]),
}


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    overrides, _ = WINDOWED[request.param]
    return make_tiny(request.param, tmp_path_factory.mktemp(f"{request.param}-swa"), overrides=overrides)


def test_each_layer_gets_the_window_its_config_gives_it(windowed: TinyModel) -> None:
    windows = [layer.sliding_window for layer in attention_layers(windowed.load())]
    assert windows == WINDOWED[windowed.name][1]


def test_greedy_decode_beyond_the_window_is_token_identical_to_hf_generate(windowed: TinyModel) -> None:
    harness = PagedHarness(windowed.load(), num_blocks=128)
    batch = prompts(windowed.hf_model.config.vocab_size, (20, 33, 9, 41), seed=5)
    names = [f"r{i}" for i in range(len(batch))]
    for name, p in zip(names, batch):
        harness.add(name, p)
    out = harness.step([(name, len(p)) for name, p in zip(names, batch)])
    for name, p in zip(names, batch):
        assert (out[name] - hf_logits(windowed, p)).abs().max() < ATOL, name
    generated: dict[str, list[int]] = {name: [] for name in names}
    for _ in range(24):
        for name in names:
            token = int(out[name][-1].argmax())
            generated[name].append(token)
            harness.seqs[name].tokens.append(token)
        out = harness.step([(name, 1) for name in names])
    for name, p in zip(names, batch):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = windowed.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                             do_sample=False)
        assert generated[name] == ref[0, len(p):].tolist(), name


def test_chunked_prefill_and_a_prefix_hit_beyond_the_window_match_hf(windowed: TinyModel) -> None:
    harness = PagedHarness(windowed.load(), num_blocks=96, block_size=4)
    long, other, suffix = prompts(windowed.hf_model.config.vocab_size, (45, 6, 7), seed=6)
    harness.add("long", long)
    harness.add("other", other)
    out = harness.step([("other", len(other))])
    chunks = []
    while harness.seqs["long"].num_computed < len(long):  # chunks of 7 across block boundaries, next to a decode
        harness.seqs["other"].tokens.append(int(out["other"][-1].argmax()))
        remaining = len(long) - harness.seqs["long"].num_computed
        out = harness.step([("long", min(7, remaining)), ("other", 1)])
        chunks.append(out["long"])
        expected = hf_logits(windowed, harness.seqs["other"].tokens)[-1]
        assert (out["other"][-1] - expected).abs().max() < ATOL
    assert (torch.cat(chunks) - hf_logits(windowed, long)).abs().max() < ATOL
    hit = long[:40] + suffix  # ten full blocks of `long` cached: 40 tokens, more than the window
    harness.add("hit", hit, shared_blocks=harness.seqs["long"].blocks[:10], num_computed=40)
    out = harness.step([("hit", len(suffix))])
    assert (out["hit"] - hf_logits(windowed, hit)[40:]).abs().max() < ATOL


# through the engine's own scheduler: batched prompts, chunks of 6 tokens, preemption by recompute; each
# variant also has a prefix-cache hit of a 24-token shared prefix (longer than the window)
ENGINE_VARIANTS = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 6},
    "preemption": {"num_gpu_blocks_override": 40, "max_num_seqs": 6},
}


@pytest.fixture(scope="module")
def engine_case(windowed: TinyModel) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (the last two share a 24-token prefix) and transformers' 24 greedy tokens for each."""
    from tests.engine.test_llm import hf_greedy

    vocab = windowed.hf_model.config.vocab_size
    shared = prompts(vocab, (24,), seed=7)[0]
    batch = prompts(vocab, (20, 33, 9, 41), seed=8) + [shared + tail for tail in prompts(vocab, (3, 11), seed=9)]
    return batch, [hf_greedy(windowed.hf_model, p, 24) for p in batch]


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_the_engine_generates_beyond_the_window_like_hf_generate(
    windowed: TinyModel, engine_case: tuple[list[list[int]], list[list[int]]], variant: str
) -> None:
    from llmplug import SamplingParams
    from tests.engine.test_llm import assert_no_leak, generate_ids, make_llm

    batch, expected = engine_case
    llm = make_llm(windowed, **ENGINE_VARIANTS[variant])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = generate_ids(llm, batch[:5], params) + generate_ids(llm, batch[5:], params)  # the second: a prefix hit
    assert llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats.hits >= 24
    assert got == expected
    assert_no_leak(llm)
    if variant == "preemption":
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
