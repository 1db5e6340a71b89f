"""The triton attention backend (under triton's interpreter) gives the same attention as torch_sdpa for every
kind of request a step can mix, over steps that reuse the cache it wrote, and refuses what it cannot run."""

from __future__ import annotations

import random

import pytest
import torch

from llmplug.layers.attention import Attention, bind_kv_cache
from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.attention.triton_backend import TritonAttentionBackend
from llmplug.layers.forward_context import CommonAttentionMetadata, forward_context

D = 16
NUM_BLOCKS = 48


def make_layer(backend, heads: int, kv_heads: int, block_size: int) -> Attention:
    layer = Attention(heads, D, D**-0.5, kv_heads, prefix="layers.0.attn")
    cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, block_size, kv_heads, D))
    bind_kv_cache(layer, [cache], backend)
    return layer


def common_metadata(spans: list[tuple[int, int]], tables: list[list[int]], block_size: int) -> CommonAttentionMetadata:
    """The flattened step computing tokens [start, stop) of each request (as the model runner builds it)."""
    q_lens, seq_lens = [b - a for a, b in spans], [b for _, b in spans]
    width = max(len(t) for t in tables)
    positions = [p for a, b in spans for p in range(a, b)]
    slots = [t[p // block_size] * block_size + p % block_size for t, (a, b) in zip(tables, spans) for p in range(a, b)]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens),
        num_computed_tokens=torch.tensor([a for a, _ in spans]),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor(slots),
        positions=torch.tensor(positions),
        block_size=block_size, num_reqs=len(spans), num_tokens=len(positions), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_lens_list=tuple(q_lens), seq_lens_list=tuple(seq_lens),
    )


def run_both(shapes: list[tuple[int, int]], heads: int, kv_heads: int, block_size: int, seed: int = 0) -> None:
    """Requests of (context, new) tokens: a first step writes the contexts, a second computes the new tokens;
    both backends see the same q, k, v and must agree on every output row of both steps."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in shapes]
    total = [c + n for c, n in shapes]
    qkv = [(torch.randn(t, heads * D, generator=gen), torch.randn(t, kv_heads * D, generator=gen),
            torch.randn(t, kv_heads * D, generator=gen)) for t in total]
    layers = [make_layer(b, heads, kv_heads, block_size) for b in (TorchSDPABackend, TritonAttentionBackend)]
    first = [r for r, (c, _) in enumerate(shapes) if c]
    steps = [[(r, 0, shapes[r][0]) for r in first]] if first else []
    steps.append([(r, c, c + n) for r, (c, n) in enumerate(shapes)])
    for step in steps:
        common = common_metadata([(a, b) for _, a, b in step], [tables[r] for r, _, _ in step], block_size)
        rows = [torch.cat([qkv[r][i][a:b] for r, a, b in step]) for i in range(3)]
        outs = []
        for layer in layers:
            with forward_context(layer.backend.build_metadata(common)):
                outs.append(layer(*rows))
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_step_matches_torch_sdpa(heads: int, kv_heads: int, block_size: int) -> None:
    # decode, chunk after a cached chunk, fresh prompt crossing a block, long decode, 1-token prompt, prefix hit
    shapes = [(9, 1), (block_size, 5), (0, block_size + 3), (2 * block_size + 1, 1), (0, 1), (block_size, 3)]
    run_both(shapes, heads, kv_heads, block_size, seed=heads + block_size)


def test_pure_decode_and_pure_prefill_steps_match_torch_sdpa() -> None:
    run_both([(3, 1), (17, 1), (40, 1)], 4, 2, 16)
    run_both([(0, 20), (0, 2), (0, 33)], 4, 2, 16, seed=1)


def test_cache_layout_puts_a_tokens_kv_heads_in_one_slot() -> None:
    layer = make_layer(TritonAttentionBackend, 4, 2, 16)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2 * D, generator=gen), torch.randn(3, 2 * D, generator=gen)
    common = common_metadata([(0, 3)], [[5]], 16)
    with forward_context(TritonAttentionBackend.build_metadata(common)):
        layer(torch.randn(3, 4 * D, generator=gen), k, v)
    assert torch.equal(layer.kv_cache[0, 5, :3].reshape(3, -1), k)  # [K/V, block, offset, Hkv, D]
    assert torch.equal(layer.kv_cache[1, 5, :3].reshape(3, -1), v)


def test_without_a_cache_the_error_says_to_bind_one() -> None:
    layer = Attention(4, D, 1.0, 2, prefix="model.layers.0.attn")
    bind_kv_cache(layer, None, TritonAttentionBackend)
    with forward_context(TritonAttentionBackend.build_metadata(common_metadata([(0, 2)], [[0]], 16))):
        with pytest.raises(RuntimeError, match="model.layers.0.attn.*bind_kv_cache"):
            layer(torch.zeros(2, 4 * D), torch.zeros(2, 2 * D), torch.zeros(2, 2 * D))


def test_on_cpu_outside_the_interpreter_the_error_names_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = make_layer(TritonAttentionBackend, 4, 2, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with forward_context(TritonAttentionBackend.build_metadata(common_metadata([(0, 2)], [[0]], 16))):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            layer(torch.zeros(2, 4 * D), torch.zeros(2, 2 * D), torch.zeros(2, 2 * D))
