"""`llmplug_cpu::int4_matmul` through `NativeInt4`, against a float64 product over `Int4Groups.dequantize()` (the
weights rounded once to the activation dtype), for one plane (Q4_0/Q4_1, quantized weights) and two (Q8_0), in each
of the packed forms: float32, float16 (GGUF's own scales and minimums) or bfloat16 group parameters, and Q8_0's two
planes as int8 codes.

Under LLMPLUG_CPU_MARCH=x86-64-v2 (as tests/engine/test_isa_caps.py runs the other kernels' tests) this file checks
the generic code path; under skylake-avx512, the AVX-512 path without AVX512-BF16.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmplug.core.config import DEFAULT_MODEL
from llmplug.layers.kernels.amx_linear import AMX_ENV
from llmplug.layers.kernels.int4_matmul import NativeInt4, native_int4_available
from llmplug.layers.kernels.native import ops
from llmplug.layers.quantization import Int4Groups
from llmplug.loaders.default_model import resolve_model_path
from llmplug.loaders.gguf import int4_groups_of_tensor, open_gguf

pytestmark = pytest.mark.skipif(not native_int4_available(), reason="llmplug's CPU kernels cannot be built here")

ROOT = Path(__file__).resolve().parents[3]
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


def fp16_values(shape: tuple[int, ...], generator: torch.Generator, scale: float) -> torch.Tensor:
    """Random float16 numbers as float32, as a GGUF block's d and m are read (llmplug.loaders.gguf._half)."""
    return (torch.randn(shape, generator=generator) * scale).half().float()


def gguf_groups(kind: str, n: int, k: int, seed: int = 0) -> Int4Groups:
    """Int4Groups as the GGUF loader decodes a Q4_0, Q4_1 or Q8_0 matrix: float16 d (and m), zeros m + 8 d in float32
    (Q4_1), 8 d (Q4_0), or Q8_0's two planes 16 d (hi - 8) + [d (lo - 8) + 8 d]."""
    generator = torch.Generator().manual_seed(seed)
    d = (fp16_values((n, k // 32), generator, 0.01).abs() + 2.0**-14).half().float()  # positive, as llama.cpp's
    if kind == "Q8_0":
        biased = torch.randint(0, 256, (n, k), generator=generator, dtype=torch.uint8)  # q8 + 128
        q = torch.stack([biased >> 4, biased & 15])
        return Int4Groups(q, torch.stack([16 * d, d]), torch.stack([torch.zeros_like(d), 8 * d]), 32)
    q = torch.randint(0, 16, (1, n, k), generator=generator, dtype=torch.uint8)
    zero = 8 * d if kind == "Q4_0" else fp16_values((n, k // 32), generator, 0.05) + 8 * d
    return Int4Groups(q, d[None], zero[None], 32)


# the packed forms: (groups maker, exact) -> which layout pack must choose
FORMS = {
    "float32 groups": (lambda n, k, planes, seed: random_groups(n, k, planes, seed=seed), True),
    "bfloat16 groups": (lambda n, k, planes, seed: random_groups(n, k, planes, seed=seed), False),
    "float16 groups": (lambda n, k, planes, seed: gguf_groups("Q4_1" if planes == 1 else "Q8_0", n, k, seed), True),
    "Q4_0": (lambda n, k, planes, seed: gguf_groups("Q4_0", n, k, seed), True),
    "Q8_0 bfloat16 groups": (lambda n, k, planes, seed: gguf_groups("Q8_0", n, k, seed), False),
}


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


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("planes, n, k", CASES)
def test_kernel_equals_x_times_the_dequantized_weight(planes: int, n: int, k: int, dtype: torch.dtype, form: str):
    make, exact = FORMS[form]
    groups = make(n, k, planes, n)
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
    assert NativeInt4.pack(groups, dtype, exact).scales.dtype == (torch.float32 if exact else torch.bfloat16)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind, codes, params", [
    ("Q4_0", torch.uint8, torch.float16), ("Q4_1", torch.uint8, torch.float16), ("Q8_0", torch.int8, torch.float16),
])
def test_gguf_groups_pack_narrow_and_keep_their_weights_bit_for_bit(
    kind: str, codes: torch.dtype, params: torch.dtype, dtype: torch.dtype
):
    groups = gguf_groups(kind, 37, 160, seed=7)
    packed = NativeInt4.pack(groups, dtype)
    assert (packed.qweight.dtype, packed.scales.dtype, packed.zeros.dtype) == (codes, params, params)
    assert packed.num_planes == groups.num_planes
    if codes == torch.int8:  # one code a weight, one scale a group, no zeros: 1.0625 bytes a weight, not 1.5
        assert packed.qweight.shape == (37, 160) and packed.scales.shape == (37, 5) and packed.zeros.shape == (37, 0)
    decoded = packed.matmul(torch.eye(160, dtype=dtype))
    assert torch.equal(decoded.T, reference_weight(groups, dtype))


def test_q8_0_codes_whose_products_would_differ_from_the_planes_stay_two_planes():
    """q8 * d is the planes' sum exactly, except for a zero's sign: 0 * (-d) and (-1) * 0 are -0, the planes' sum +0.
    pack checks every weight's bits, so such groups keep the two-plane form, and their weights."""
    for sign, code in ((-1.0, 0), (0.0, -1)):  # a negative scale with a zero code; a zero scale with a negative code
        groups = gguf_groups("Q8_0", 6, 64, seed=8)
        scale = groups.scale[1].clone()
        scale[2, 1] = sign * scale[2, 1]
        q = groups.q.clone()
        q[0, 2, 40], q[1, 2, 40] = (code + 128) >> 4, (code + 128) & 15
        groups = Int4Groups(q, torch.stack([16 * scale, scale]), torch.stack([groups.zero[0], 8 * scale]), 32)
        packed = NativeInt4.pack(groups, torch.float32)
        assert packed.qweight.dtype == torch.uint8 and packed.num_planes == 2
        decoded = packed.matmul(torch.eye(64)).T
        assert torch.equal(decoded.view(torch.int32), groups.dequantize().view(torch.int32))


@pytest.mark.parametrize("scale_of, equal", [
    (lambda d: d.masked_fill(torch.arange(d.numel()).reshape(d.shape) % 3 == 0, 0.0), True),  # +0, codes >= 0
    (lambda d: d * (1 + 2.0**-20), None),  # not float16: no proof, each product checked against the planes
], ids=["zero scales", "float32 scales"])
def test_q8_0_codes_are_used_where_the_products_are_the_planes_sums(scale_of, equal: bool | None):
    """Int8 codes exactly where q8 * d (computed here) has every weight's bits; for +0 scales and codes >= 0 it has."""
    groups = gguf_groups("Q8_0", 6, 64, seed=10)
    scale = scale_of(groups.scale[1])
    q = groups.q.clone()
    q[0] = q[0].clamp(min=8)  # hi >= 8: q8 >= 0 everywhere
    groups = Int4Groups(q, torch.stack([16 * scale, scale]), torch.stack([groups.zero[0], 8 * scale]), 32)
    q8 = q[0].float() * 16 + q[1].float() - 128
    products_equal = torch.equal((q8 * scale.repeat_interleave(32, -1)).view(torch.int32),
                                 groups.dequantize().view(torch.int32))
    packed = NativeInt4.pack(groups, torch.float32)
    assert (packed.qweight.dtype == torch.int8) == products_equal
    decoded = packed.matmul(torch.eye(64)).T
    assert torch.equal(decoded.view(torch.int32), groups.dequantize().view(torch.int32))
    assert equal is None or products_equal == equal


def test_group_parameters_float16_cannot_hold_stay_float32():
    groups = gguf_groups("Q4_1", 8, 64, seed=9)
    inexact_zero = groups.zero.clone()
    inexact_zero[0, 3, 1] += 1e-7  # no float16 minimum m gives this zero as m + 8 d
    inexact_scale = groups.scale.clone()
    inexact_scale[0, 5, 0] *= 1 + 2.0**-20
    for scale, zero in ((groups.scale, inexact_zero), (inexact_scale, groups.zero)):
        changed = Int4Groups(groups.q, scale, zero, 32)
        packed = NativeInt4.pack(changed, torch.float32)
        assert packed.scales.dtype == packed.zeros.dtype == torch.float32
        assert torch.equal(packed.matmul(torch.eye(64)).T, changed.dequantize())


@pytest.fixture(scope="module")
def default_model_head() -> Int4Groups:
    """The Q8_0 LM head (token_embd, tied) of the default model, as its loader decodes it: two int4 planes."""
    reader = open_gguf(resolve_model_path(DEFAULT_MODEL))
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type.name == "Q8_0"
    return int4_groups_of_tensor(tensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_default_models_q8_0_head_packs_as_int8_with_its_weights_bit_for_bit(
    default_model_head: Int4Groups, dtype: torch.dtype
):
    packed = NativeInt4.pack(default_model_head, dtype)  # checks all 49152 rows' products against the planes
    assert (packed.qweight.dtype, packed.scales.dtype) == (torch.int8, torch.float16)
    bytes_per_weight = sum(t.numel() * t.element_size() for t in (packed.qweight, packed.scales, packed.zeros)) / (
        packed.qweight.numel())
    assert bytes_per_weight == 1 + 2 / 32
    rows = torch.cat([torch.arange(0, 1000), torch.arange(49152 - 999, 49152)])  # both ends, a last tile of 3
    part = Int4Groups(*(t[:, rows] for t in (default_model_head.q, default_model_head.scale,
                                              default_model_head.zero)), 32)
    sliced = NativeInt4(packed.qweight[rows], packed.scales[rows], packed.zeros[rows], 32, dtype)
    decoded = sliced.matmul(torch.eye(576, dtype=dtype)).T
    assert torch.equal(decoded.float().view(torch.int32), part.dequantize().to(dtype).float().view(torch.int32))


def test_every_code_of_a_group_decodes_to_its_value():
    k = 32  # one group, one column per code pattern: column c holds code (c + i) % 16 at k = i
    q = ((torch.arange(16)[:, None] + torch.arange(k)[None, :]) % 16).to(torch.uint8)[None]
    scale = torch.linspace(0.5, 2.0, 16)[None, :, None]
    zero = torch.linspace(-1.0, 1.0, 16)[None, :, None]
    groups = Int4Groups(q, scale, zero, k)
    decoded = NativeInt4.pack(groups, torch.float32).matmul(torch.eye(k))
    assert torch.equal(decoded.T, (q[0].float() - 8) * scale[0] + zero[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("planes, form", [
    (1, "float32 groups"), (2, "float32 groups"), (1, "bfloat16 groups"), (1, "float16 groups"), (2, "float16 groups"),
])
def test_each_output_row_is_bitwise_the_same_whatever_the_number_of_rows_or_threads(
    planes: int, form: str, dtype: torch.dtype
):
    n, k = 70, 608  # a last tile of 2 columns; k an odd number of groups (19: a last run of 3 after 16)
    make, exact = FORMS[form]
    packed = NativeInt4.pack(make(n, k, planes, 3), dtype, exact)
    assert (packed.qweight.dtype == torch.int8) == (form == "float16 groups" and planes == 2)
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


def test_rows_read_in_place_give_the_contiguous_rows_bits():
    """x's rows may lie apart (a slice of a fused output), an odd number of elements: the kernel reads them in place."""
    n, k = 70, 608
    packed = NativeInt4.pack(FORMS["float16 groups"][0](n, k, 1, 3), torch.bfloat16, True)
    wide = rows(40, k + 3, torch.bfloat16, seed=5)
    for m in (1, 5, 16, 17, 33, 40):
        x = wide[:m, 1 : k + 1]
        assert x.stride(0) == k + 3
        assert torch.equal(packed.matmul(x), packed.matmul(x.contiguous())), m


def lanes_tree_sum(v: torch.Tensor) -> torch.Tensor:
    """The kernel's sum of 16 float32 lanes (the last dim), in float32: lanes j and j + 8, then 4, 2 and 1 apart."""
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]


def test_float32_outputs_are_the_16_lanes_summed_in_the_kernels_tree_for_every_tile_shape():
    """float32 activations: lane j holds the products of k = j mod 16, the lanes summed in a fixed tree, whatever
    rows and columns the tile that computes them has. Each lane here holds one exact product (integer weights,
    x a signed power of two at k < 16, 0 beyond), of magnitudes far apart, so another order of the adds shows."""
    n, k = 7, 32  # a tile of 4 columns and one of 3
    generator = torch.Generator().manual_seed(11)
    q = torch.randint(0, 16, (1, n, k), generator=generator, dtype=torch.uint8)
    groups = Int4Groups(q, torch.ones(1, n, 1), torch.zeros(1, n, 1), k)  # w = q - 8 exactly
    packed = NativeInt4.pack(groups, torch.float32)
    signs = torch.randint(0, 2, (40, 16), generator=generator) * 2 - 1
    x = torch.zeros(40, k)
    x[:, :16] = signs * torch.exp2(torch.randint(-20, 21, (40, 16), generator=generator).float())
    products = x[:, None, :16] * (q[0, :, :16].float() - 8)  # [M, N, 16], each exact
    expected = lanes_tree_sum(products)
    assert (expected != products.sum(-1)).any() and (expected != products.flip(-1).cumsum(-1)[..., -1]).any()
    for m in range(1, 41):  # every row count of a fused tile (1..4) and of the buffered tiles after it
        assert torch.equal(packed.matmul(x[:m]).view(torch.int32), expected[:m].view(torch.int32)), m


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
    (lambda x, q, s, z: (x, q.int(), s, z, 32), "qweight must be contiguous uint8 \\[N, P, K / 2\\] or int8"),
    (lambda x, q, s, z: (x, q[:, :, :16].contiguous(), s, z, 32), "x has 64 columns, qweight's rows hold 32"),
    (lambda x, q, s, z: (x, q, s, z, 48), "group_size must be a positive multiple of 32"),
    (lambda x, q, s, z: (x, q, s[:, :1].contiguous(), z, 32), "scales must be \\[N, P, K / group_size\\]"),
    (lambda x, q, s, z: (x, q, s, z.double(), 32), "zeros must be contiguous float32, float16 or bfloat16"),
    (lambda x, q, s, z: (x, q, s, z.half(), 32), "scales are Float, zeros Half"),
    (lambda x, q, s, z: (x, q, s, z.bfloat16(), 32), "scales are Float, zeros BFloat16"),
    (lambda x, q, s, z: (x, q, s, z[:, :, :1].contiguous(), 32), "zeros must be \\[N, P, K / group_size\\]"),
])
def test_bad_arguments_are_refused_by_name_then_a_good_call_works(args, named):
    x, qweight, scales, zeros = _good()
    with pytest.raises(RuntimeError, match=named):
        ops().int4_matmul(*args(x, qweight, scales, zeros))
    y = ops().int4_matmul(x, qweight, scales, zeros, 32)
    assert y.shape == (2, 9)


def _good_int8() -> tuple[torch.Tensor, ...]:
    packed = NativeInt4.pack(gguf_groups("Q8_0", 9, 64, seed=6), torch.float32)
    return torch.randn(2, 64), packed.qweight, packed.scales, packed.zeros


@pytest.mark.parametrize("args, named", [
    (lambda x, q, s, z: (x, q.view(torch.uint8), s, z, 32), "qweight must be contiguous uint8"),
    (lambda x, q, s, z: (x, q[:, :32].contiguous(), s, z, 32), "x has 64 columns, qweight's rows hold 32"),
    (lambda x, q, s, z: (x, q, s[None], z, 32), "scales must be \\[N, K / group_size\\] \\(int8 codes\\)"),
    (lambda x, q, s, z: (x, q, s, s, 32), "zeros must be \\[N, 0\\] \\(int8 codes have no zeros\\)"),
    (lambda x, q, s, z: (x, q, s, z.float(), 32), "scales are Half, zeros Float"),
])
def test_bad_int8_arguments_are_refused_by_name_then_a_good_call_works(args, named):
    x, qweight, scales, zeros = _good_int8()
    with pytest.raises(RuntimeError, match=named):
        ops().int4_matmul(*args(x, qweight, scales, zeros))
    assert ops().int4_matmul(x, qweight, scales, zeros, 32).shape == (2, 9)


@pytest.mark.parametrize("good", [_good, _good_int8], ids=["int4 planes", "int8 codes"])
def test_the_op_passes_torchs_opcheck_its_fake_included(good):
    """The schema, and the fake registered for torch.compile (native/__init__.py) agreeing with the kernel."""
    x, qweight, scales, zeros = good()
    checks = torch.library.opcheck(ops().int4_matmul.default, (x, qweight, scales, zeros, 32))
    assert set(checks.values()) == {"SUCCESS"}, checks


# The AMX path (bfloat16 activations where AMX runs; LLMPLUG_CPU_AMX=0 turns it off, read once per process, so
# each switch is computed in a subprocess and checked here): TDPBF16PS sums each output over the K blocks in order,
# its own order, not the AVX-512 lanes'.
AMX_CASES = [  # (form, planes, n, k): one and two planes, int8 codes, 3 planes; partial column tiles (n % 16)
    ("float16 groups", 1, 200, 576), ("float16 groups", 2, 70, 608), ("Q4_0", 1, 70, 608),
    ("float32 groups", 1, 37, 96), ("float32 groups", 2, 13, 160), ("bfloat16 groups", 3, 33, 96),
]
AMX_ROWS = (1, 5, 16, 17, 33, 64, 70)  # one B tile, several, a second pass over the decoded weights (65+)
AMX_INVARIANCE = [(1, "float16 groups"), (2, "float16 groups"), (2, "float32 groups"), (3, "float32 groups")]
AMX_INVARIANCE_ROWS = [*range(1, 41), 64, 65, 130]


def amx_capable() -> bool:
    """Whether the kernels here are built with AMX code (this CPU's flags, `-march=native`)."""
    from llmplug.core.cpuinfo import cpu_flags
    from llmplug.layers.kernels.native import MARCH_ENV

    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags() and os.environ.get(MARCH_ENV, "native") in (
        "", "native")


def cancelling(k: int = 64) -> NativeInt4:
    """16 columns of 2^24, 31 ones, -2^24 (at k = 32), 31 ones: each float32 summation order loses its own ones."""
    q = torch.full((2, 16, k), 8, dtype=torch.uint8)
    q[0, :, 0] = q[0, :, 32] = 9
    q[1, :, 0] = 7
    scale, zero = torch.ones(2, 16, k // 32), torch.zeros(2, 16, k // 32)
    scale[0, :, 0], scale[0, :, 1], zero[1] = 2.0**24, -(2.0**24), 1
    return NativeInt4.pack(Int4Groups(q, scale, zero, 32), torch.bfloat16)


def invariance_case(planes: int, form: str) -> tuple[NativeInt4, torch.Tensor]:
    make, exact = FORMS[form]
    x = rows(130, 608, torch.bfloat16, seed=4)
    x[:, 0], x[:, -1] = 2.0**10, -(2.0**10)  # large values that cancel: any change of order shows in the bits
    return NativeInt4.pack(make(70, 608, planes, 3), torch.bfloat16, exact), x


def amx_outputs(path: str, cases: bool = True) -> None:
    """The AMX cases' outputs (`cases`, else the cancelling sum's alone), saved to `path` (run under
    LLMPLUG_CPU_AMX=1, and =0, by the `amx` fixture)."""
    results: dict = {"cancelling": cancelling().matmul(torch.ones(1, 64, dtype=torch.bfloat16))}
    if not cases:
        return torch.save(results, path)
    packed, x = invariance_case(1, "float16 groups")
    strided = torch.cat([x, x[:, :1]], dim=1)[:, :-1]  # rows 609 apart: pairs of x not 4-byte aligned
    results["strided"] = packed.matmul(strided[:33]), packed.matmul(x[:33])
    for form, planes, n, k in AMX_CASES:
        make, exact = FORMS[form]
        packed = NativeInt4.pack(make(n, k, planes, n), torch.bfloat16, exact=exact)
        results[form, planes] = [packed.matmul(rows(m, k, torch.bfloat16, seed=m)) for m in AMX_ROWS]
    for planes, form in AMX_INVARIANCE:
        packed, x = invariance_case(planes, form)
        by_rows = {m: packed.matmul(x[:m]) for m in AMX_INVARIANCE_ROWS}
        by_rows["alone"] = torch.cat([packed.matmul(x[i : i + 1]) for i in range(x.shape[0])])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            by_rows[f"{threads} threads"] = packed.matmul(x)
        results["rows", planes, form] = by_rows
    torch.save(results, path)


@pytest.fixture(scope="module")
def amx(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not amx_capable():
        pytest.skip("no AMX here (CPU flags, or a build for another -march)")
    directory = tmp_path_factory.mktemp("amx")
    outputs = {}
    for switch in ("1", "0"):
        path = directory / f"{switch}.pt"
        code = (f"from tests.layers.kernels.test_int4_matmul import amx_outputs; "
                f"amx_outputs({str(path)!r}, cases={switch == '1'})")
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, AMX_ENV: switch},
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[switch] = torch.load(path)
    return {**outputs["1"], "cancelling off": outputs["0"]["cancelling"]}


def test_the_amx_switch_changes_the_summation_order(amx: dict):
    """Under LLMPLUG_CPU_AMX=1 the kernel sums in TDPBF16PS's order (the ones the cancelling weights lose differ),
    within float32's bound of the exact 62 either way; under =0, the AVX-512 lanes' order."""
    bound = 64 * 2.0**-24 * (2.0**25 + 62)  # k roundings of float32 sums of |x| |w|
    for y in (amx["cancelling"], amx["cancelling off"]):
        assert ((y.double() - 62).abs() <= bound).all()
    assert not torch.equal(amx["cancelling"], amx["cancelling off"])


@pytest.mark.parametrize("form, planes, n, k", AMX_CASES)
def test_the_amx_path_equals_x_times_the_dequantized_weight(amx: dict, form: str, planes: int, n: int, k: int):
    make, exact = FORMS[form]
    groups = make(n, k, planes, n)
    weight = reference_weight(groups, torch.bfloat16, exact).double()
    assert (NativeInt4.pack(groups, torch.bfloat16, exact).qweight.dtype == torch.int8) == (form == "float16 groups"
                                                                                             and planes == 2)
    for m, y in zip(AMX_ROWS, amx[form, planes]):
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        x = rows(m, k, torch.bfloat16, seed=m).double()
        expected = x @ weight.T
        # k float32 adds in order (each rounding within 2^-24 of the running sum), then the output's rounding
        bound = k * 2.0**-24 * (x.abs() @ weight.abs().T) + EPS[torch.bfloat16] * expected.abs()
        assert ((y.double() - expected).abs() <= bound).all(), (m, (y.double() - expected).abs().max())


def test_amx_strided_rows_are_the_contiguous_rows_bits(amx: dict):
    strided, contiguous = amx["strided"]
    assert torch.equal(strided, contiguous)


@pytest.mark.parametrize("planes, form", AMX_INVARIANCE)
def test_amx_rows_are_bitwise_the_same_whatever_the_number_of_rows_or_threads(amx: dict, planes: int, form: str):
    by_rows = amx["rows", planes, form]
    alone = by_rows["alone"]
    for m in AMX_INVARIANCE_ROWS:
        assert torch.equal(by_rows[m], alone[:m]), m
    assert torch.equal(by_rows["1 threads"], alone) and torch.equal(by_rows["2 threads"], alone)
