"""TorchSDPABackend attends exactly like plain per-request causal attention over each request's whole
history, for every kind of request one mixed step can hold, through the paged cache."""

from __future__ import annotations

import random

import pytest
import torch

from llmplug.layers.attention import Attention, bind_kv_cache
from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.forward_context import CommonAttentionMetadata, forward_context
from llmplug.layers.kernels.native import KERNELS_ENV


@pytest.fixture(autouse=True, params=["auto", "0"], ids=["cpu-kernels", "torch-paths"])
def kernel_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test on llmplug's CPU kernels (the default) and on the backend's torch paths."""
    monkeypatch.setenv(KERNELS_ENV, request.param)


BLOCK = 4
D = 16


class Request:
    """A request's full history of q, k, v, of which the first `context` tokens are already cached."""

    def __init__(self, context: int, new: int, heads: int, kv_heads: int, blocks: list[int], gen: torch.Generator):
        self.context, self.new, self.blocks = context, new, blocks
        total = context + new
        self.q = torch.randn(total, heads * D, generator=gen)
        self.k = torch.randn(total, kv_heads * D, generator=gen)
        self.v = torch.randn(total, kv_heads * D, generator=gen)

    def slots(self, start: int, stop: int) -> list[int]:
        return [self.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, stop)]


def make_layer(heads: int, kv_heads: int, num_blocks: int, cached: bool = True, dtype=torch.float32) -> Attention:
    layer = Attention(heads, D, D**-0.5, kv_heads, prefix="layers.0.attn")
    cache = torch.zeros(TorchSDPABackend.kv_cache_shape(num_blocks, BLOCK, kv_heads, D), dtype=dtype)
    bind_kv_cache(layer, [cache] if cached else None, TorchSDPABackend)
    return layer


def run_step(layer: Attention, reqs: list[Request], spans: list[tuple[int, int]], dtype=torch.float32) -> torch.Tensor:
    """One flattened step computing tokens [start, stop) of each request."""
    q_lens = [stop - start for start, stop in spans]
    seq_lens = [stop for _, stop in spans]
    width = max(len(r.blocks) for r in reqs)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.cumsum(torch.tensor(q_lens), 0).tolist()]),
        seq_lens=torch.tensor(seq_lens),
        num_computed_tokens=torch.tensor([start for start, _ in spans]),
        block_tables=torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in reqs]),
        slot_mapping=torch.tensor([s for r, (a, b) in zip(reqs, spans) for s in r.slots(a, b)]),
        positions=torch.tensor([p for a, b in spans for p in range(a, b)]),
        block_size=BLOCK, num_reqs=len(reqs), num_tokens=sum(q_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_lens_list=tuple(q_lens), seq_lens_list=tuple(seq_lens),
    )
    rows = lambda name: torch.cat([getattr(r, name)[a:b] for r, (a, b) in zip(reqs, spans)]).to(dtype)  # noqa: E731
    with forward_context(TorchSDPABackend.build_metadata(common)):
        return layer(rows("q"), rows("k"), rows("v"))


def reference(layer: Attention, reqs: list[Request]) -> torch.Tensor:
    """Plain causal attention of each request's new tokens over its whole history."""
    outs = []
    g = layer.num_heads // layer.num_kv_heads
    for r in reqs:
        total = r.context + r.new
        q = r.q[r.context :].view(r.new, layer.num_heads, D).transpose(0, 1)  # [H, new, D]
        k = r.k.view(total, layer.num_kv_heads, D).transpose(0, 1).repeat_interleave(g, 0)  # [H, total, D]
        v = r.v.view(total, layer.num_kv_heads, D).transpose(0, 1).repeat_interleave(g, 0)
        scores = q @ k.transpose(1, 2) * layer.scale
        allowed = torch.arange(total)[None, :] <= (r.context + torch.arange(r.new))[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append((probs @ v).transpose(0, 1).reshape(r.new, -1))
    return torch.cat(outs)


def scenario(
    shapes: list[tuple[int, int]], heads: int, kv_heads: int, seed: int = 0
) -> tuple[Attention, list[Request]]:
    """Requests of (context, new) tokens whose contexts are written by an earlier prefill step."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    free = list(range(64))
    rng.shuffle(free)
    reqs = []
    for context, new in shapes:
        blocks = [free.pop() for _ in range(-(-(context + new) // BLOCK))]
        reqs.append(Request(context, new, heads, kv_heads, blocks, gen))
    layer = make_layer(heads, kv_heads, 64)
    with_context = [r for r in reqs if r.context]
    if with_context:
        run_step(layer, with_context, [(0, r.context) for r in with_context])
    return layer, reqs


def check(layer: Attention, reqs: list[Request], dtype=torch.float32, atol: float = 1e-5) -> None:
    out = run_step(layer, reqs, [(r.context, r.context + r.new) for r in reqs], dtype)
    torch.testing.assert_close(out.float(), reference(layer, reqs), rtol=0, atol=atol)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_mixed_step_of_decodes_chunks_prompts_and_prefix_hits(heads: int, kv_heads: int) -> None:
    # decode, chunk after cached chunks, fresh prompt, decode, 1-token prompt, prefix hit of 8 tokens
    layer, reqs = scenario([(9, 1), (8, 5), (0, 6), (20, 1), (0, 1), (8, 3)], heads, kv_heads)
    check(layer, reqs)


def test_pure_decode_with_equal_and_unequal_lengths() -> None:
    layer, reqs = scenario([(7, 1), (7, 1), (7, 1)], 4, 2)  # seq_len 8 fills two blocks: no mask
    check(layer, reqs)
    layer, reqs = scenario([(3, 1), (12, 1), (30, 1)], 4, 2, seed=1)
    check(layer, reqs)


def test_single_prompt_and_batch_of_prompts_with_nothing_cached() -> None:
    layer, reqs = scenario([(0, 11)], 4, 2)
    check(layer, reqs)
    layer, reqs = scenario([(0, 11), (0, 2), (0, 7)], 4, 2, seed=2)
    check(layer, reqs)


def test_new_keys_are_written_to_their_slots() -> None:
    layer, reqs = scenario([(0, 6), (0, 3)], 4, 2)
    run_step(layer, reqs, [(0, 6), (0, 3)])
    later_layer_view = layer.kv_cache.view(2, 2, -1, D)  # [K/V, Hkv, slot, D]
    for r in reqs:
        slots = torch.tensor(r.slots(0, r.new))
        torch.testing.assert_close(later_layer_view[0][:, slots].transpose(0, 1).reshape(r.new, -1), r.k)
        torch.testing.assert_close(later_layer_view[1][:, slots].transpose(0, 1).reshape(r.new, -1), r.v)


def test_bfloat16_decode_stays_close_to_float32() -> None:
    gen = torch.Generator().manual_seed(3)
    reqs = [Request(0, n, 4, 2, [i * 8 + b for b in range(8)], gen) for i, n in enumerate((13, 20, 9))]
    layer = make_layer(4, 2, 32, dtype=torch.bfloat16)
    run_step(layer, reqs, [(0, r.new - 1) for r in reqs], torch.bfloat16)
    for r in reqs:
        r.context, r.new = r.new - 1, 1
    check(layer, reqs, torch.bfloat16, atol=3e-2)


def test_without_a_cache_prompts_run_and_decodes_are_refused() -> None:
    gen = torch.Generator().manual_seed(4)
    reqs = [Request(0, n, 4, 2, [0, 1, 2], gen) for n in (5, 9)]
    layer = make_layer(4, 2, 4, cached=False)
    torch.testing.assert_close(run_step(layer, reqs, [(0, 5), (0, 9)]), reference(layer, reqs), rtol=0, atol=1e-5)
    torch.testing.assert_close(run_step(layer, reqs[:1], [(0, 5)]), reference(layer, reqs[:1]), rtol=0, atol=1e-5)
    with pytest.raises(RuntimeError, match="KV cache"):
        run_step(layer, reqs[:1], [(4, 5)])


def test_bind_kv_cache_binds_layers_in_order_and_checks_the_count() -> None:
    model = torch.nn.Sequential(Attention(2, D, 1.0, prefix="a"), torch.nn.ReLU(), Attention(2, D, 1.0, prefix="b"))
    caches = [torch.zeros(1), torch.zeros(2)]
    assert bind_kv_cache(model, caches, TorchSDPABackend) == 2
    assert model[0].kv_cache is caches[0] and model[2].kv_cache is caches[1] and model[2].backend is TorchSDPABackend
    with pytest.raises(ValueError, match="3 KV caches for 2 Attention layers"):
        bind_kv_cache(model, caches + [torch.zeros(1)], TorchSDPABackend)


def test_unbound_layer_says_how_to_bind() -> None:
    layer = Attention(2, D, 1.0, prefix="model.layers.3.self_attn.attn")
    with pytest.raises(RuntimeError, match="bind_kv_cache"):
        layer(torch.zeros(1, 2 * D), torch.zeros(1, 2 * D), torch.zeros(1, 2 * D))
