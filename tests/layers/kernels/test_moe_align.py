"""The MoE token-grouping kernel equals its one-expert-at-a-time torch reference under triton's interpreter,
and with block size 1 it is exactly the stable argsort the experts layer groups with on the torch path."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.kernels.moe_align import moe_align_block_size
from llmplug.layers.kernels.reference import moe_align_block_size_ref


def routed_ids(tokens: int, top_k: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct experts per token, as a router picks them, drawn from the first half of the experts when
    there are more than k of them there: the other half gets no token."""
    pool = experts // 2 if experts // 2 >= top_k else experts
    return torch.rand(tokens, pool, generator=gen).argsort(dim=1)[:, :top_k]


ROUTINGS = [(k, e) for k in (1, 2, 8) for e in (4, 8, 64) if k <= e]  # a token's k experts are distinct


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize(("top_k", "experts"), ROUTINGS)
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_kernel_matches_reference(tokens: int, top_k: int, experts: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(tokens * 1000 + top_k * 100 + experts + block_size)
    ids = routed_ids(tokens, top_k, experts, gen)
    expected = moe_align_block_size_ref(ids, experts, block_size)
    got = moe_align_block_size(ids, experts, block_size)
    for name, g, e in zip(("sorted_ids", "offsets", "counts"), got, expected):
        assert g.dtype == torch.int32 and torch.equal(g, e), name
    offsets, counts = got[1], got[2]
    assert bool((offsets.diff() % block_size == 0).all())
    if experts > 2 * top_k:  # the unrouted half of the experts: no rows
        assert int(counts[experts // 2 :].sum()) == 0


@pytest.mark.parametrize("tokens", [1, 300])
def test_block_size_one_is_the_stable_argsort(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, 8, (tokens, 2), generator=gen)  # repeated experts per token too
    sorted_ids, offsets, counts = moe_align_block_size(ids, 8, 1)
    assert torch.equal(sorted_ids.long(), ids.flatten().argsort(stable=True))
    assert torch.equal(counts.long(), torch.bincount(ids.flatten(), minlength=8))
    assert int(offsets[-1]) == ids.numel()


def test_no_tokens_and_bad_block_size() -> None:
    sorted_ids, offsets, counts = moe_align_block_size(torch.empty(0, 2, dtype=torch.int64), 4, 16)
    assert torch.equal(sorted_ids, torch.zeros(4 * 15, dtype=torch.int32))  # padding only: the sentinel T * k = 0
    assert not offsets.any() and not counts.any()
    with pytest.raises(ValueError, match="block_size"):
        moe_align_block_size(torch.zeros(3, 2, dtype=torch.int64), 4, 0)
