"""The generic decoder matches transformers (fp32) for Llama, Mistral, Qwen2 and Qwen3 tiny models,
through the paged KV cache: flattened prefill, batched greedy decode, chunked prefill, prefix hits."""

from __future__ import annotations

import torch

from llmplug.testing.paged import PagedHarness
from .tiny_models import TinyModel

ATOL = 1e-4
PROMPT_LENS = (7, 12, 3, 17)


def prompts(vocab: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    """Random prompts of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lens]


def hf_logits(tiny: TinyModel, tokens: list[int]) -> torch.Tensor:
    """transformers' logits [len(tokens), vocab] for one sequence."""
    with torch.no_grad():
        return tiny.hf_model(torch.tensor([tokens])).logits[0]


def test_flattened_prefill_of_mixed_lengths_matches_hf(tiny: TinyModel) -> None:
    harness = PagedHarness(tiny.load())
    batch = prompts(tiny.hf_model.config.vocab_size)
    for i, p in enumerate(batch):
        harness.add(f"r{i}", p)
    out = harness.step([(f"r{i}", len(p)) for i, p in enumerate(batch)])
    diffs = [(out[f"r{i}"] - hf_logits(tiny, p)).abs().max().item() for i, p in enumerate(batch)]
    print(f"{tiny.name}: max abs logit diff {max(diffs):.2e}")
    assert max(diffs) < ATOL


def test_batched_greedy_decode_is_token_identical_to_hf_generate(tiny: TinyModel) -> None:
    harness = PagedHarness(tiny.load(), num_blocks=96)
    batch = prompts(tiny.hf_model.config.vocab_size)
    names = [f"r{i}" for i in range(len(batch))]
    for name, p in zip(names, batch):
        harness.add(name, p)
    out = harness.step([(name, len(p)) for name, p in zip(names, batch)])
    generated: dict[str, list[int]] = {name: [] for name in names}
    for _ in range(32):
        for name in names:
            token = int(out[name][-1].argmax())
            generated[name].append(token)
            harness.seqs[name].tokens.append(token)
        out = harness.step([(name, 1) for name in names])  # every request decodes in one batch
    for name, p in zip(names, batch):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = tiny.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        assert generated[name] == ref[0, len(p) :].tolist(), name


def _greedy_next(harness: PagedHarness, name: str, logits: torch.Tensor) -> None:
    harness.seqs[name].tokens.append(int(logits[-1].argmax()))


def test_chunked_prefill_mixed_with_decodes_matches_hf(tiny: TinyModel) -> None:
    harness = PagedHarness(tiny.load())
    long, b, c = prompts(tiny.hf_model.config.vocab_size, (17, 6, 9), seed=2)
    harness.add("long", long)
    harness.add("b", b)
    harness.add("c", c)
    out = harness.step([("b", len(b)), ("c", len(c))])
    _greedy_next(harness, "b", out["b"])
    _greedy_next(harness, "c", out["c"])
    chunks: list[torch.Tensor] = []
    # orders vary so the chunk sits first, between and after the decodes (non-contiguous parts)
    for order in (["long", "b", "c"], ["b", "long", "c"], ["b", "c", "long"], ["c", "long", "b"]):
        remaining = len(long) - harness.seqs["long"].num_computed
        out = harness.step([(n, min(5, remaining) if n == "long" else 1) for n in order])
        chunks.append(out["long"])
        for name in ("b", "c"):
            seq = harness.seqs[name]
            expected = hf_logits(tiny, seq.tokens)[-1]
            assert (out[name][-1] - expected).abs().max() < ATOL, name
            _greedy_next(harness, name, out[name])
    assert (torch.cat(chunks) - hf_logits(tiny, long)).abs().max() < ATOL


def test_prefix_cache_hit_reuses_blocks_and_matches_hf(tiny: TinyModel) -> None:
    harness = PagedHarness(tiny.load(), block_size=4)
    first, suffix = prompts(tiny.hf_model.config.vocab_size, (10, 5), seed=3)
    harness.add("first", first)
    out = harness.step([("first", len(first))])
    _greedy_next(harness, "first", out["first"])
    second = first[:8] + suffix  # shares the first two full blocks
    shared = harness.seqs["first"].blocks[:2]
    harness.add("second", second, shared_blocks=shared, num_computed=8)
    out = harness.step([("first", 1), ("second", len(second) - 8)])
    assert harness.seqs["second"].blocks[:2] == shared
    assert (out["second"] - hf_logits(tiny, second)[8:]).abs().max() < ATOL
    assert (out["first"][-1] - hf_logits(tiny, harness.seqs["first"].tokens)[-1]).abs().max() < ATOL
