"""`llmplug_cpu::fp8_matmul`, fp8 weights (float8_e4m3fn) with their scales (llmplug.quantization.fp8), against
a float64 product over the reference dequantization: float32(q) * scale rounded once to the activation dtype,
as transformers' and DeepSeek's `weight_dequant` define it (tests/quantization/test_fp8.py ties the two).

test_isa_caps runs this file under the generic x86-64-v2 build too.
"""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.kernels.native import native_available, ops

pytestmark = pytest.mark.skipif(not native_available(), reason="llmplug's CPU kernels cannot be built here")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # the output's rounding


def codes(n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k] random e4m3fn weights: every code but the two NaNs (which loading refuses) is likely."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=generator, dtype=torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0x40  # 2.0
    return q.view(torch.float8_e4m3fn)


def scales(layout: str, n: int, k: int, seed: int) -> torch.Tensor:
    """float32 scales of `layout`: 128x128 blocks, per row and block (the layer's form), per row, per tensor."""
    rows = {"block": -(-n // 128), "row-block": n, "channel": n, "tensor": 1}[layout]
    columns = -(-k // 128) if layout in ("block", "row-block") else 1
    return torch.rand(rows, columns, generator=torch.Generator().manual_seed(seed)) * 1e-3 + 1e-4


def reference_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32(q) * its scale, rounded once to `dtype` (transformers' Fp8Dequantize, DeepSeek's weight_dequant)."""
    n, k = q.shape
    if scale.shape[0] == n:
        rows = torch.arange(n)
    else:  # per 128-row block, or one for all
        rows = torch.arange(n) // 128 if scale.shape[0] == -(-n // 128) else torch.zeros(n, dtype=torch.long)
    columns = torch.arange(k) // 128 if scale.shape[1] > 1 else torch.zeros(k, dtype=torch.long)
    return (q.float() * scale[rows][:, columns]).to(dtype)


CASES = [("block", 133, 300), ("row-block", 70, 257), ("channel", 37, 201), ("tensor", 129, 95)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout, n, k", CASES)
def test_kernel_equals_x_times_the_reference_dequantized_weight(layout: str, n: int, k: int, dtype: torch.dtype):
    q, scale = codes(n, k, seed=n), scales(layout, n, k, seed=k)
    weight = reference_weight(q, scale, dtype).double()
    for m in (1, 4, 5, 33):  # rows decoded in registers (up to 4) and from a decoded tile (more)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = ops().fp8_matmul(x, q, scale)
        assert y.dtype == dtype and y.shape == (m, n)
        expected = x.double() @ weight.T
        # float32 sums of k products, then the output's one rounding to dtype
        bound = 1e-6 * (x.double().abs() @ weight.abs().T) + EPS[dtype] * expected.abs()
        assert ((y.double() - expected).abs() <= bound).all(), (m, (y.double() - expected).abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernels_weights_are_the_reference_dequantization_bit_for_bit(dtype: torch.dtype):
    q = torch.arange(256, dtype=torch.uint8)
    q = q[(q & 0x7F) != 0x7F].reshape(2, 127).repeat(3, 1).view(torch.float8_e4m3fn)  # every code, 6 rows
    scale = torch.tensor([[3.0517578125e-05], [0.0123], [1.7], [0.25], [7.3e-3], [1e-4]])
    decoded = ops().fp8_matmul(torch.eye(127, dtype=dtype), q, scale)  # x = I: y = W^T, exactly
    assert torch.equal(decoded.T, reference_weight(q, scale, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_output_row_is_bitwise_the_same_whatever_the_number_of_rows_or_threads(dtype: torch.dtype):
    n, k = 70, 300  # a last tile of 2 columns; k not a multiple of the 16 or 32 lanes
    q, scale = codes(n, k, seed=1), scales("block", n, k, seed=2)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    alone = torch.cat([ops().fp8_matmul(x[i : i + 1], q, scale) for i in range(33)])
    for m in range(1, 34):
        assert torch.equal(ops().fp8_matmul(x[:m], q, scale), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(ops().fp8_matmul(x, q, scale), alone)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_and_an_empty_batch():
    q, scale = codes(9, 64, seed=4), scales("tensor", 9, 64, seed=5)
    x = torch.randn(5, 128)[:, ::2]  # rows 128 apart, columns 2 apart
    assert torch.equal(ops().fp8_matmul(x, q, scale), ops().fp8_matmul(x.contiguous(), q, scale))
    assert ops().fp8_matmul(torch.randn(0, 64), q, scale).shape == (0, 9)


@pytest.mark.parametrize("args, named", [
    (lambda q, s: (torch.randn(2, 64), q.view(torch.uint8), s), "float8_e4m3fn w"),
    (lambda q, s: (torch.randn(2, 63), q, s), "x has 63 columns"),
    (lambda q, s: (torch.randn(2, 64).double(), q, s), "x must be float32, bfloat16 or float16"),
    (lambda q, s: (torch.randn(2, 64), q, torch.ones(3, 1)), "scale has 3 rows"),
    (lambda q, s: (torch.randn(2, 64), q, torch.ones(9, 2)), "scale has 2 columns"),
    (lambda q, s: (torch.randn(2, 64), q, s.double()), "scale must be contiguous float32"),
])
def test_bad_arguments_are_refused_by_name_then_a_good_call_works(args, named):
    q, scale = codes(9, 64, seed=6), scales("channel", 9, 64, seed=7)
    with pytest.raises(RuntimeError, match=named):
        ops().fp8_matmul(*args(q, scale))
    x = torch.randn(2, 64)
    expected = x.double() @ reference_weight(q, scale, torch.float32).double().T
    assert (ops().fp8_matmul(x, q, scale).double() - expected).abs().max() <= 1e-5 * expected.abs().max()
