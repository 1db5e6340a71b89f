"""The score arithmetic of the optional attention features, shared by backends.

Order, as in transformers: scores = q . k * scale; soft-capping; + ALiBi bias and mask; softmax,
whose denominator also holds the head's sink logit when the layer has sinks.
"""

from __future__ import annotations

import math

import torch

__all__ = ["alibi_slopes", "softcap_", "softmax_with_sinks"]


def alibi_slopes(total_num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """ALiBi slopes [total_num_heads] (float32), as Bloom, Falcon and MPT (`alibi_bias_max`) compute them.

    Head h of n (rounded up to a power of two, N) gets 2 ** (-max_bias * (h + 1) / N); when n is not a
    power of two the even-numbered slopes come first, then the odd ones, cut to n (Bloom's
    `_get_alibi_slopes` gives the same values for max_bias 8).
    """
    if total_num_heads < 1:
        raise ValueError(f"alibi_slopes: total_num_heads={total_num_heads} must be positive")
    padded = 2 ** math.ceil(math.log2(total_num_heads))
    slopes = 2.0 ** (-max_bias / padded * torch.arange(1, padded + 1, dtype=torch.float64))
    if padded != total_num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:total_num_heads]
    return slopes.to(torch.float32)


def softcap_(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(scores / cap), in place."""
    return scores.div_(cap).tanh_().mul_(cap)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim, with `sinks` (broadcast to scores[..., :1]) as one more logit each
    row drops after normalising; in scores' dtype, computed in float32. A fully masked row gives zeros."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    logits = scores.float()
    total = torch.logaddexp(torch.logsumexp(logits, dim=-1, keepdim=True), sinks.float())
    return torch.exp(logits - total).to(scores.dtype)
