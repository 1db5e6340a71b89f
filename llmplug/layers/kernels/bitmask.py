"""The guided-decoding token bitmask applied to logits in place (Triton).

Bit j of word i of a row's bitmask [ceil(V / 32)] int32 allows token 32 i + j (xgrammar's layout);
a disallowed token's logit becomes -inf, and tokens past the bitmask's width are disallowed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmplug.layers.kernels import require_triton_device

__all__ = ["apply_token_bitmask_"]

BLOCK_V = 1024  # tokens per program


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, stride_l, stride_b, vocab, num_words, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    words = tokens // 32
    word = tl.load(bitmask_ptr + row * stride_b + words, mask=(tokens < vocab) & (words < num_words), other=0)
    allowed = ((word >> (tokens % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + tokens, float("-inf"), mask=(tokens < vocab) & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits [B, V] (columns contiguous) of tokens bitmask [B, W] int32 does not allow."""
    require_triton_device(logits, "apply_token_bitmask_")
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or bitmask.stride(1) != 1 or bitmask.dtype != torch.int32:
        raise ValueError("apply_token_bitmask_ needs contiguous columns and an int32 bitmask")
    if rows:
        grid = (rows, triton.cdiv(vocab, BLOCK_V))
        _apply_bitmask_kernel[grid](logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, bitmask.shape[1],
                                    BLOCK_V=BLOCK_V)
    return logits
