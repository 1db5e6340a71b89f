"""Element-wise functions whose result for a row does not depend on how many rows the tensor has.

torch's CPU kernels run an element-wise op over the flat tensor as a vectorized body plus a scalar tail,
and for transcendental functions (sigmoid, silu, softplus, log1p, ...) the two round differently. A row
narrower than the vector, or whose width is not a multiple of it, lands partly in the body or the tail
depending on its index and on the number of rows: then a token's gate, routing score or step size (and
everything after it) depends on its batch, which the batch-invariant mode (docs/determinism.md) rules out.
Padding each row to whole vectors puts every element in the body, whatever the batch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from llmplug.layers.kernels.native import ops, use_native

__all__ = ["VECTOR_ELEMENTS", "rowwise", "rowwise_bmm"]

VECTOR_ELEMENTS = 64  # a multiple of every SIMD width (in elements) torch's CPU kernels use, for every dtype


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an element-wise `fn`, computed on rows padded to whole vectors (a no-op when they are)."""
    width = x.shape[-1]
    pad = -width % VECTOR_ELEMENTS
    if pad == 0 and x.is_contiguous():
        return fn(x)
    return fn(F.pad(x, (0, pad)))[..., :width]


def rowwise_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [N, M, K] @ b [N, K, L] such that each row of the result does not depend on M.

    On the CPU, llmplug's kernel (`llmplug_cpu::row_bmm`: each row's float32 sums on one thread in one fixed
    order). Elsewhere, or without the kernels, MKL's batched matmul with `a` contiguous and a lone row computed
    as two: on some CPUs that gives a row the same bits for any M >= 2 (it takes a matrix-vector kernel for
    one row), but not on all (an AMD EPYC with AVX512-VP2INTERSECT changes kernels with M).
    """
    if use_native(a):
        if b.stride(2) != 1 and b.stride(1) != 1:
            b = b.contiguous()
        return ops().row_bmm(a, b)
    rows = a.shape[1]
    a = torch.cat([a, a], dim=1) if rows == 1 else a.contiguous()
    return torch.bmm(a, b)[:, :rows]
