"""`llmplug_cpu::int4_matmul` through `NativeInt4`, against a float64 product over `Int4Groups.dequantize()` (the
weights rounded once to the activation dtype), for one plane (Q4_0/Q4_1, quantized weights) and two (Q8_0).

Under LLMPLUG_CPU_MARCH=x86-64-v2 (as tests/engine/test_isa_caps.py runs the other kernels' tests) this file checks
the generic code path; under skylake-avx512, the AVX-512 path without AVX512-BF16.
"""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.kernels.int4_matmul import NativeInt4, native_int4_available
from llmplug.layers.kernels.native import ops
from llmplug.layers.quantization import Int4Groups

pytestmark = pytest.mark.skipif(not native_int4_available(), reason="llmplug's CPU kernels cannot be built here")

DTYPES = [torch.float32, torch.bfloat16]
EPS = {torch.float32: 0.0, torch.bfloat16: 2.0**-8}  # the output's rounding


def random_groups(n: int, k: int, planes: int, group_size: int = 32, seed: int = 0) -> Int4Groups:
    """Random codes (every value 0..15 likely) with positive scales and signed zeros, of a plausible weight's size."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (planes, n, k), generator=generator, dtype=torch.uint8)
    groups = (planes, n, k // group_size)
    scale = torch.rand(groups, generator=generator) * 0.02 + 1e-3
    zero = torch.randn(groups, generator=generator) * 0.01
    return Int4Groups(q, scale, zero, group_size)


def reference_weight(groups: Int4Groups, dtype: torch.dtype, exact: bool = True) -> torch.Tensor:
    """The weight the kernel is meant to compute with: the groups' float32 dequantization (of scales and zeros
    rounded to bfloat16 first unless `exact`), rounded once to dtype."""
    if not exact:
        scale, zero = (t.to(torch.bfloat16).float() for t in (groups.scale, groups.zero))
        groups = Int4Groups(groups.q, scale, zero, groups.group_size)
    return groups.dequantize().to(dtype)


def rows(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


# odd multiples of the group size and of the 4-column tile's remainders
CASES = [(1, 37, 96), (1, 70, 608), (2, 13, 160), (2, 64, 576)]


@pytest.mark.parametrize("exact", [True, False], ids=["float32 groups", "bfloat16 groups"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("planes, n, k", CASES)
def test_kernel_equals_x_times_the_dequantized_weight(planes: int, n: int, k: int, dtype: torch.dtype, exact: bool):
    groups = random_groups(n, k, planes, seed=n)
    weight = reference_weight(groups, dtype, exact).double()
    packed = NativeInt4.pack(groups, dtype, exact=exact)
    for m in (1, 3, 4, 5, 33):  # rows decoded in registers (up to 4) and from a decoded tile (more)
        x = rows(m, k, dtype, seed=m)
        y = packed.matmul(x)
        assert y.dtype == dtype and y.shape == (m, n)
        expected = x.double() @ weight.T
        # float32 sums of k products, then the output's one rounding to dtype
        bound = 1e-6 * (x.double().abs() @ weight.abs().T) + EPS[dtype] * expected.abs()
        assert ((y.double() - expected).abs() <= bound).all(), (m, (y.double() - expected).abs().max())


@pytest.mark.parametrize("exact", [True, False], ids=["float32 groups", "bfloat16 groups"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("planes", [1, 2, 3])
def test_the_kernels_weights_are_the_dequantized_weights_bit_for_bit(planes: int, dtype: torch.dtype, exact: bool):
    groups = random_groups(9, 128, planes, group_size=64, seed=planes)
    decoded = NativeInt4.pack(groups, dtype, exact).matmul(torch.eye(128, dtype=dtype))  # x = I: y = W^T, exactly
    if not exact:
        scale, zero = (t.to(torch.bfloat16).float() for t in (groups.scale, groups.zero))
        groups = Int4Groups(groups.q, scale, zero, groups.group_size)
    expected = reference_weight(groups, dtype)
    if planes == 3:  # torch may sum three planes in another order: the kernel adds them in order, each add rounded
        q = groups.q.float() - 8
        scale, zero = (t.repeat_interleave(groups.group_size, dim=-1) for t in (groups.scale, groups.zero))
        parts = q * scale + zero
        expected = ((parts[0] + parts[1]) + parts[2]).to(dtype)
    assert torch.equal(decoded.T, expected)


def test_every_code_of_a_group_decodes_to_its_value():
    k = 32  # one group, one column per code pattern: column c holds code (c + i) % 16 at k = i
    q = ((torch.arange(16)[:, None] + torch.arange(k)[None, :]) % 16).to(torch.uint8)[None]
    scale = torch.linspace(0.5, 2.0, 16)[None, :, None]
    zero = torch.linspace(-1.0, 1.0, 16)[None, :, None]
    groups = Int4Groups(q, scale, zero, k)
    decoded = NativeInt4.pack(groups, torch.float32).matmul(torch.eye(k))
    assert torch.equal(decoded.T, (q[0].float() - 8) * scale[0] + zero[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("planes, exact", [(1, True), (2, True), (1, False)])
def test_each_output_row_is_bitwise_the_same_whatever_the_number_of_rows_or_threads(
    planes: int, exact: bool, dtype: torch.dtype
):
    n, k = 70, 608  # a last tile of 2 columns; k an odd number of groups
    packed = NativeInt4.pack(random_groups(n, k, planes, seed=3), dtype, exact)
    x = rows(130, k, dtype, seed=4)
    # large values that cancel, as int4_rows_invariant's probe: any change of summation order shows in the bits
    x[:, 0], x[:, -1] = 2.0**10, -(2.0**10)
    alone = torch.cat([packed.matmul(x[i : i + 1]) for i in range(x.shape[0])])
    for m in [*range(1, 41), 65, 130]:
        assert torch.equal(packed.matmul(x[:m]), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(packed.matmul(x), alone)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_and_an_empty_batch():
    packed = NativeInt4.pack(random_groups(9, 64, 1, seed=5), torch.float32)
    x = torch.randn(5, 128)[:, ::2]  # rows 128 apart, columns 2 apart
    assert torch.equal(packed.matmul(x), packed.matmul(x.contiguous()))
    assert packed.matmul(torch.randn(0, 64)).shape == (0, 9)


def test_packing_refuses_what_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        NativeInt4.pack(random_groups(4, 64, 1), torch.float16)
    with pytest.raises(ValueError, match="multiple of 32"):
        NativeInt4.pack(random_groups(4, 48, 1, group_size=16), torch.float32)


def _good() -> tuple[torch.Tensor, ...]:
    packed = NativeInt4.pack(random_groups(9, 64, 2, seed=6), torch.float32)
    return torch.randn(2, 64), packed.qweight, packed.scales, packed.zeros


@pytest.mark.parametrize("args, named", [
    (lambda x, q, s, z: (x[0], q, s, z, 32), "x must be \\[M, K\\]"),
    (lambda x, q, s, z: (x.double(), q, s, z, 32), "x must be float32 or bfloat16"),
    (lambda x, q, s, z: (x, q.int(), s, z, 32), "qweight must be contiguous uint8"),
    (lambda x, q, s, z: (x, q[:, :, :16].contiguous(), s, z, 32), "x has 64 columns, qweight's rows hold 32"),
    (lambda x, q, s, z: (x, q, s, z, 48), "group_size must be a positive multiple of 32"),
    (lambda x, q, s, z: (x, q, s[:, :1].contiguous(), z, 32), "scales must be \\[N, P, K / group_size\\]"),
    (lambda x, q, s, z: (x, q, s, z.half(), 32), "zeros must be contiguous float32 or bfloat16"),
    (lambda x, q, s, z: (x, q, s, z.bfloat16(), 32), "scales are Float, zeros BFloat16"),
    (lambda x, q, s, z: (x, q, s, z[:, :, :1].contiguous(), 32), "zeros must be \\[N, P, K / group_size\\]"),
])
def test_bad_arguments_are_refused_by_name_then_a_good_call_works(args, named):
    x, qweight, scales, zeros = _good()
    with pytest.raises(RuntimeError, match=named):
        ops().int4_matmul(*args(x, qweight, scales, zeros))
    y = ops().int4_matmul(x, qweight, scales, zeros, 32)
    assert y.shape == (2, 9)


def test_the_op_passes_torchs_opcheck_its_fake_included():
    """The schema, and the fake registered for torch.compile (native/__init__.py) agreeing with the kernel."""
    x, qweight, scales, zeros = _good()
    checks = torch.library.opcheck(ops().int4_matmul.default, (x, qweight, scales, zeros, 32))
    assert set(checks.values()) == {"SUCCESS"}, checks
