"""The fixed-order attention arithmetic (layers/attention/fixed_order.py): correct against a float64 softmax, and
a row's result bitwise the same however many rows share the call and however far its keys are padded."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.attention.fixed_order import scores_fp32, softmax_weighted_sum

TILE = 64


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """q [N, M, D] over keys/values [N, L, D] with keep-mask seen [N, M, L] -> [N, M, D] float32."""
    scores = scores_fp32(q, keys.transpose(1, 2)).masked_fill_(~seen, float("-inf"))
    return softmax_weighted_sum(scores, values, TILE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_a_float64_softmax(dtype) -> None:
    torch.manual_seed(0)
    q, keys, values = torch.randn(3, 5, 16).to(dtype), torch.randn(3, 128, 16).to(dtype), torch.randn(3, 128, 16)
    seen = torch.arange(128)[None, None, :] < torch.tensor([100, 128, 7])[:, None, None]
    seen = seen.expand(3, 5, 128)
    expected = torch.softmax((q.double() @ keys.double().transpose(1, 2)).masked_fill(~seen, float("-inf")), -1)
    expected = expected @ values.to(dtype).double()
    torch.testing.assert_close(attend(q, keys, values.to(dtype), seen).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_bitwise_the_same_alone_among_other_rows_and_with_padded_keys(threads, head_dim) -> None:
    torch.manual_seed(1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, keys, values = torch.randn(1, 40, head_dim), torch.randn(1, 512, head_dim), torch.randn(1, 512, head_dim)
        length = 70  # the request's keys: two tiles, the second partly seen
        seen = torch.ones(1, 1, 2 * TILE, dtype=torch.bool)
        seen[..., length:] = False
        alone = attend(q[:, :1], keys[:, : 2 * TILE], values[:, : 2 * TILE], seen)
        for rows in (2, 3, 17, 40):  # more query rows in the call, keys padded to 8 tiles
            seen_padded = torch.zeros(1, rows, 512, dtype=torch.bool)
            seen_padded[..., :length] = True
            assert torch.equal(attend(q[:, :rows], keys, values, seen_padded)[:, :1], alone), rows
    finally:
        torch.set_num_threads(previous)


def test_keys_that_are_not_whole_tiles_are_an_error() -> None:
    with pytest.raises(ValueError, match="not whole tiles of 64"):
        softmax_weighted_sum(torch.zeros(1, 2, 70), torch.zeros(1, 70, 4), TILE)
