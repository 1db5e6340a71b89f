"""The paged-attention kernel equals its torch reference under triton's interpreter: decodes, prompts and
chunked-prefill chunks of random lengths in one launch, over shuffled block tables, for GQA ratios 1, 4, 8,
block sizes 16 and 32, and every attention feature (window, chunk, soft-cap, ALiBi, sinks)."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.kernels.paged_attention import paged_attention
from llmplug.layers.kernels.reference import paged_attention_ref

D = 32
NUM_KV_HEADS = 2


def random_step(
    gen: torch.Generator, block_size: int, q_lens: list[int], seq_lens: list[int], heads: int, dtype=torch.float32
) -> dict:
    """A step's queries and a filled cache; each request's blocks are scattered over the cache."""
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int64)
    used = 0
    for r, n in enumerate(blocks_per_req):
        tables[r, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, NUM_KV_HEADS, D)
    return dict(
        q=torch.randn(sum(q_lens), heads, D, generator=gen).to(dtype),
        key_cache=torch.randn(shape, generator=gen).to(dtype),
        value_cache=torch.randn(shape, generator=gen).to(dtype),
        block_tables=tables,
    )


def run_both(step: dict, q_lens: list[int], seq_lens: list[int], **features) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full_like(step["q"], float("nan"))
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    paged_attention(
        out, step["q"], step["key_cache"], step["value_cache"], step["block_tables"], torch.tensor(seq_lens),
        query_start_loc, max_query_len=max(q_lens), scale=D**-0.5, **features,
    )
    ref = paged_attention_ref(
        step["q"], step["key_cache"], step["value_cache"], step["block_tables"], seq_lens, q_lens, scale=D**-0.5,
        **features,
    )
    return out.float(), ref


def mixed_lengths(gen: torch.Generator, block_size: int) -> tuple[list[int], list[int]]:
    """Decodes, a prompt and a chunk with cached context, with lengths that cross block boundaries."""
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    q_lens = [1, rand(2, 2 * block_size + 5), 1, rand(2, 20)]
    seq_lens = [rand(2, 3 * block_size), q_lens[1], block_size + 1, q_lens[3] + rand(1, 2 * block_size)]
    return q_lens, seq_lens


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_mixed_step_matches_reference_for_gqa_ratios_and_block_sizes(group: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    q_lens, seq_lens = mixed_lengths(gen, block_size)
    step = random_step(gen, block_size, q_lens, seq_lens, NUM_KV_HEADS * group)
    out, ref = run_both(step, q_lens, seq_lens)
    assert (out - ref).abs().max() < 1e-5


def test_decode_only_step_matches_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    seq_lens = [1, 16, 17, 33, 64]
    step = random_step(gen, 16, [1] * len(seq_lens), seq_lens, NUM_KV_HEADS * 4)
    out, ref = run_both(step, [1] * len(seq_lens), seq_lens)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_sliding_window_edges_match_reference(window: int) -> None:
    """Windows of one key, inside a block, exactly one block, one past a block, and longer than some requests."""
    gen = torch.Generator().manual_seed(window)
    q_lens, seq_lens = [1, 30, 9, 1], [48, 30, 39, 17]
    step = random_step(gen, 16, q_lens, seq_lens, NUM_KV_HEADS * 2)
    out, ref = run_both(step, q_lens, seq_lens, sliding_window=window)
    assert (out - ref).abs().max() < 1e-5
    full, _ = run_both(step, q_lens, seq_lens)
    assert window >= max(seq_lens) or (out - full).abs().max() > 1e-3  # the window did change something


@pytest.mark.parametrize("chunk", [5, 16, 20])
def test_chunked_attention_edges_match_reference(chunk: int) -> None:
    """Chunks inside a block, exactly one block, across blocks; queries of a chunk-spanning prompt and decodes."""
    gen = torch.Generator().manual_seed(chunk)
    q_lens, seq_lens = [1, 30, 9, 1], [48, 30, 39, 17]
    step = random_step(gen, 16, q_lens, seq_lens, NUM_KV_HEADS * 2)
    out, ref = run_both(step, q_lens, seq_lens, attention_chunk=chunk)
    assert (out - ref).abs().max() < 1e-5
    windowed, _ = run_both(step, q_lens, seq_lens, sliding_window=chunk)
    assert (out - windowed).abs().max() > 1e-3  # a chunk is not a window of its length


@pytest.mark.parametrize(
    "features",
    [
        {"logit_softcap": 2.0},
        {"alibi_slopes": "slopes"},
        {"sinks": "sinks"},
        {"sliding_window": 6, "logit_softcap": 3.0, "sinks": "sinks"},
    ],
    ids=["softcap", "alibi", "sinks", "window+softcap+sinks"],
)
def test_features_match_reference(features: dict) -> None:
    gen = torch.Generator().manual_seed(3)
    heads = NUM_KV_HEADS * 4
    values = {"slopes": torch.rand(heads, generator=gen), "sinks": torch.randn(heads, generator=gen) * 2}
    features = {name: values.get(value, value) for name, value in features.items()}
    q_lens, seq_lens = mixed_lengths(gen, 16)
    step = random_step(gen, 16, q_lens, seq_lens, heads)
    out, ref = run_both(step, q_lens, seq_lens, **features)
    assert (out - ref).abs().max() < 1e-5


def test_bf16_inputs_match_the_upcast_reference() -> None:
    """bf16 q and cache: the kernel accumulates in float32; the reference upcasts the same bf16 values."""
    gen = torch.Generator().manual_seed(11)
    q_lens, seq_lens = mixed_lengths(gen, 16)
    step = random_step(gen, 16, q_lens, seq_lens, NUM_KV_HEADS * 4, dtype=torch.bfloat16)
    out, ref = run_both(step, q_lens, seq_lens)
    assert (out - ref).abs().max() < 3e-2  # bf16 output rounding and bf16 probabilities in p @ v


def test_strided_queries_and_outputs_are_read_and_written_in_place() -> None:
    """q as a slice of a fused qkv row and out as a slice of a wider buffer (what the backend passes)."""
    gen = torch.Generator().manual_seed(5)
    q_lens, seq_lens = [3, 1], [3, 20]
    heads = NUM_KV_HEADS * 2
    step = random_step(gen, 16, q_lens, seq_lens, heads)
    qkv = torch.cat([step["q"].flatten(1), torch.randn(sum(q_lens), 2 * NUM_KV_HEADS * D, generator=gen)], dim=1)
    q = qkv[:, : heads * D].view(-1, heads, D)
    wide = torch.zeros(sum(q_lens), heads * D + 8)
    out = wide[:, : heads * D].view(-1, heads, D)
    paged_attention(
        out, q, step["key_cache"], step["value_cache"], step["block_tables"], torch.tensor(seq_lens),
        torch.tensor([0, 3, 4]), max_query_len=3, scale=D**-0.5,
    )
    ref = paged_attention_ref(
        q, step["key_cache"], step["value_cache"], step["block_tables"], seq_lens, q_lens, scale=D**-0.5
    )
    assert (out - ref).abs().max() < 1e-5
    assert bool((wide[:, heads * D :] == 0).all())
