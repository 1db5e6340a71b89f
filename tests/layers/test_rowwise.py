"""Element-wise functions and batched matmuls whose rows do not depend on the number of rows
(llmplug/layers/rowwise.py, used by the batch-invariant mode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmplug.layers.rowwise import rowwise, rowwise_bmm


@pytest.mark.parametrize("fn", [torch.sigmoid, F.silu, F.softplus, torch.log1p, torch.exp])
@pytest.mark.parametrize("width", [1, 3, 8, 60, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_elementwise_row_is_the_same_whatever_the_number_of_rows(fn, width, dtype) -> None:
    """Plain torch runs these as a vectorized body plus a scalar tail that round differently, and a narrow row
    falls in either by its index (on this machine torch.sigmoid of a [T, 1] tensor changes from T = 23 on);
    rowwise gives every row of 1..48 rows the bits it gets among 48."""
    x = torch.rand(48, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    full = rowwise(fn, x)
    assert full.shape == x.shape and torch.allclose(full.float(), fn(x).float(), rtol=1e-2, atol=1e-6)
    for rows in range(1, 49):
        assert torch.equal(rowwise(fn, x[:rows]), full[:rows]), f"{rows} rows"


def test_rowwise_keeps_leading_dims_and_strided_inputs() -> None:
    x = torch.rand(3, 5, 7)
    assert torch.equal(rowwise(torch.sigmoid, x), rowwise(torch.sigmoid, x.transpose(0, 1).contiguous()).transpose(0, 1))
    assert rowwise(torch.sigmoid, x[..., ::2]).shape == (3, 5, 4)


@pytest.mark.parametrize(("heads", "k", "n"), [(4, 16, 32), (2, 128, 512), (8, 64, 96)])
def test_a_batched_matmul_row_is_the_same_alone_and_among_others(heads, k, n) -> None:
    """Latent attention's absorbed matmuls: a row alone (one decode token) and among 2..16 rows, from a strided
    view as the layer passes it, on rows whose sums expose any change of summation order (+-2^19 at two
    columns with equal weights)."""
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(16, heads, k, generator=generator)
    b = torch.randn(heads, k, n, generator=generator)
    for row in range(16):
        first, last = row % 4, k - 1 - row % 4
        b[:, last] = b[:, first]
        a[row, :, first], a[row, :, last] = 2.0**19, -(2.0**19)
    full = rowwise_bmm(a.transpose(0, 1), b)  # [heads, 16, n] from a strided view
    assert torch.allclose(full, torch.bmm(a.transpose(0, 1), b), rtol=1e-4, atol=1.0)
    for rows in range(1, 17):
        assert torch.equal(rowwise_bmm(a[:rows].transpose(0, 1), b), full[:, :rows]), f"{rows} rows"
