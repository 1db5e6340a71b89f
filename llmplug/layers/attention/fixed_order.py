"""The arithmetic of batch-invariant attention: each query row reduces over its keys in one fixed order.

A query row's result must not depend on what else is in the step: how many other rows share its
matmul, how far its keys are padded to the batch's longest request, where a chunk of its prompt
starts, or whether it is a decode row or the last row of a (recomputed) prompt. Padding changes the
length a softmax or a matmul reduces over, and CPU kernels reduce a longer row in another order, so
the plain paths of TorchSDPABackend differ in the last bits (in bf16, visibly).

Here every request's keys are laid out from a tile-aligned position in tiles of `tile` keys (a fixed
tile size, not a fixed number of tiles), and:

- scores = q . k in float32 by one batched matmul of q [M, D] and the keys laid out [D, L] contiguous, whose
  rows do not depend on M (`rowwise_bmm`: llmplug's CPU kernel; without it MKL, which keeps that on some
  CPUs only);
- the row maximum (exact in any order), then exp(score - max);
- the softmax denominator and the weighted sum of the values fold tile by tile, in position order,
  each tile's sum and matmul always over exactly `tile` keys. A tile the row does not see (padding
  past its last key, or before its sliding window) adds exact zeros: it changes nothing.

So a row's result depends only on its query, its keys and the tile size, which the engine config
fixes. The test is tests/layers/test_fixed_order_attention.py and, end to end, tests/engine/test_batch_invariance.py.
"""

from __future__ import annotations

import torch

from llmplug.layers.rowwise import rowwise_bmm

__all__ = ["KEY_TILE", "key_tile", "round_up", "scores_fp32", "softmax_weighted_sum"]

KEY_TILE = 64  # keys per tile (at least; a multiple of the KV block size)


def key_tile(block_size: int) -> int:
    """Keys per tile for a KV cache of `block_size` blocks: KEY_TILE rounded up to whole blocks."""
    return -(-KEY_TILE // block_size) * block_size


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def scores_fp32(q: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
    """q [N, M, D] . keys_t [N, D, L] in float32 -> [N, M, L] (unscaled); keys_t is made contiguous."""
    return rowwise_bmm(q.float(), keys_t.float().contiguous())


def softmax_weighted_sum(
    scores: torch.Tensor, values: torch.Tensor, tile: int, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(scores) @ values, folded over tiles of `tile` keys in order -> [N, M, Dv] float32.

    scores [N, M, L] float32, masked with -inf, overwritten; L a multiple of `tile`; values [N, L, Dv];
    sinks (float32, broadcast to [N, M, 1]): one more logit per row in the denominator, with no value.
    """
    rows, length = scores.shape[1], scores.shape[2]
    if length % tile:
        raise ValueError(f"fixed-order attention: {length} keys are not whole tiles of {tile}")
    top = scores.amax(dim=-1, keepdim=True)  # [N, M, 1]
    if sinks is not None:
        sinks = sinks.expand(scores.shape[0], rows, 1)
        top = torch.maximum(top, sinks)
    top.clamp_(min=torch.finfo(top.dtype).min)  # a row that sees no key (max -inf): all its weights stay 0
    probs = scores.sub_(top).exp_()
    total, out = None, None
    for start in range(0, length, tile):
        weights = probs[:, :, start : start + tile]
        tile_total = weights.sum(dim=-1, keepdim=True)
        tile_out = rowwise_bmm(weights, values[:, start : start + tile].float())
        total = tile_total if total is None else total.add_(tile_total)
        out = tile_out if out is None else out.add_(tile_out)
    if sinks is not None:
        total.add_(torch.exp(sinks - top))
    # a seen row's total is >= 1 (its largest weight is exp(0)); a row that sees no key has total 0 and out 0
    return out.div_(total.clamp_(min=torch.finfo(total.dtype).tiny))
