"""llmplug's AMX bf16 matmul (native/amx_linear.cpp): x W^T + b against float64, each row's bits the same for any
number of rows, position or thread count, its packed layout AMX's B tiles, and the layers using it in batch-invariant
mode only where AMX runs. On a CPU without AMX, the kernel refuses by name and the layers keep oneDNN."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from llmplug.layers.kernels.amx_linear import (
    AMX_ENV,
    amx_linear_enabled,
    amx_linear_rotary,
    amx_linear_silu_and_mul,
    pack_weight,
)
from llmplug.layers.kernels.int4_matmul import NativeInt4
from llmplug.layers.kernels.native import native_available, ops
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.packed_linear import AmxLinearMethod
from llmplug.layers.quantization import Int4Groups, LinearOptions, process_weights_after_loading
from llmplug.layers.row_invariance import cancelling_weight, order_sensitive_rows

pytestmark = pytest.mark.skipif(not native_available(), reason="llmplug's CPU kernels are not built here")
needs_amx = pytest.mark.skipif(not native_available() or not amx_linear_enabled(), reason="no AMX-BF16 here")


def integer_case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """bf16 x, weight and bias of small integers: every product and partial sum is exact in float32, so the kernel's
    output must be the exact sum rounded once to bf16, whatever order it adds in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (m, k), generator=g).bfloat16()
    w = torch.randint(-8, 9, (n, k), generator=g).bfloat16()
    bias = torch.randint(-64, 65, (n,), generator=g).bfloat16()
    return x, w, bias


def test_packed_tiles_are_amxs_b_tile_layout() -> None:
    """Tile (j, t) row p holds (k = 32 t + 2 p, k + 1) of outputs 16 j .. 16 j + 15; the outputs padded to 32."""
    w = torch.arange(40 * 64, dtype=torch.float32).view(40, 64).bfloat16()
    packed = pack_weight(w)
    assert packed.shape == (4, 2, 16, 32)  # 40 outputs -> 64 (two pairs of tiles), K 64 -> 2 tiles
    for j, t, p, c in [(0, 0, 0, 0), (1, 1, 5, 7), (2, 0, 15, 13), (0, 1, 3, 16)]:
        n, k = 16 * j + c // 2, 32 * t + 2 * p + c % 2
        assert packed[j, t, p, c] == w[n, k]
    assert not packed[2, :, :, 16:].any() and not packed[3].any()  # outputs 40..63: zero rows


@needs_amx
@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (5, 40, 96), (16, 576, 576), (17, 192, 576), (70, 1536, 576),
                                     (33, 576, 1536), (3, 7, 32)])
def test_output_is_the_exact_sum_rounded_once_to_bf16(m: int, n: int, k: int) -> None:
    x, w, bias = integer_case(m, n, k, seed=m)
    expected = (x.double() @ w.double().T + bias.double()).bfloat16()
    assert torch.equal(ops().amx_linear(x, pack_weight(w), bias, n), expected)
    assert torch.equal(ops().amx_linear(x, pack_weight(w), None, n), (x.double() @ w.double().T).bfloat16())


@needs_amx
def test_random_inputs_match_float64_to_bf16_rounding() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(45, 1536, generator=g).bfloat16(), torch.randn(200, 1536, generator=g).bfloat16()
    got = ops().amx_linear(x, pack_weight(w), None, 200).double()
    expected = x.double() @ w.double().T
    scale = (x.double().abs() @ w.double().abs().T)
    assert ((got - expected).abs() <= expected.abs() * 2.0**-8 + scale * 2.0**-20).all()


@needs_amx
@pytest.mark.parametrize("n, k", [(1536, 576), (576, 1536), (40, 64)])
def test_each_row_is_bitwise_the_same_for_any_rows_position_or_threads(n: int, k: int) -> None:
    """Inputs whose rows change bits with any change of summation order (row_invariance.py's probe inputs)."""
    x = order_sensitive_rows(100, k, torch.bfloat16)
    packed = pack_weight(cancelling_weight(n, k).bfloat16())
    everything = ops().amx_linear(x, packed, None, n)
    for rows in (*range(1, 40), 47, 64, 65, 96):
        for start in (0, 3, 100 - rows):
            assert torch.equal(ops().amx_linear(x[start:start + rows], packed, None, n), everything[start:start + rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops().amx_linear(x, packed, None, n), everything)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_strided_rows_bias_dtypes_and_an_empty_batch() -> None:
    x, w, bias = integer_case(6, 48, 64)
    packed = pack_weight(w)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows 128 apart
    assert torch.equal(ops().amx_linear(wide, packed, bias, 48), ops().amx_linear(x, packed, bias, 48))
    assert torch.equal(ops().amx_linear(x, packed, bias.float(), 48), ops().amx_linear(x, packed, bias, 48))
    assert ops().amx_linear(x[:0], packed, None, 48).shape == (0, 48)


@needs_amx
@pytest.mark.parametrize("args, named", [
    (lambda x, p: (x.float(), p, None, 48), "x must be bfloat16 \\[M, K\\]"),
    (lambda x, p: (x[0], p, None, 48), "x must be bfloat16 \\[M, K\\]"),
    (lambda x, p: (x, p.float(), None, 48), "packed must be contiguous bfloat16"),
    (lambda x, p: (x[:, :32], p, None, 48), "x has 32 columns, the packed weight 64"),
    (lambda x, p: (x, p, None, 80), "out_features 80 does not fit the packed weight's 64 rows"),
    (lambda x, p: (x, p, None, 16), "out_features 16 does not fit"),
    (lambda x, p: (x, p, torch.zeros(47), 48), "bias must be \\[48\\]"),
])
def test_bad_arguments_are_refused_by_name_then_a_good_call_works(args, named) -> None:
    x, w, bias = integer_case(3, 48, 64)
    packed = pack_weight(w)
    with pytest.raises(RuntimeError, match=named):
        ops().amx_linear(*args(x, packed))
    assert torch.equal(ops().amx_linear(x, packed, bias, 48), (x.double() @ w.double().T + bias.double()).bfloat16())


@needs_amx
@pytest.mark.parametrize("m", [1, 16, 17, 33, 70])
@pytest.mark.parametrize("n", [64, 96])
def test_gate_up_through_silu_and_mul_gives_torchs_silu_of_the_exact_product(m: int, n: int) -> None:
    """gate_up's product (the gate's n / 2 outputs, then the up's) through SiLU-and-mul in one call: each output is
    torch's silu of the exact gate sum rounded to bf16, times the exact up sum rounded, as the two calls give."""
    x, w, bias = integer_case(m, n, 128, seed=m)
    packed, d = pack_weight(w), n // 2
    for b in (bias, None):
        product = (x.double() @ w.double().T + (0 if b is None else b.double())).bfloat16()
        expected = F.silu(product[:, :d]) * product[:, d:]
        assert torch.equal(amx_linear_silu_and_mul(x, packed, b, n), expected)
        assert torch.equal(ops().silu_and_mul(ops().amx_linear(x, packed, b, n)), expected)
    wide = torch.cat([x, x], dim=1)[:, :128]  # rows 256 apart
    assert torch.equal(amx_linear_silu_and_mul(wide, packed, bias, n), amx_linear_silu_and_mul(x, packed, bias, n))


@needs_amx
def test_the_fused_op_refuses_halves_that_are_not_whole_tiles_then_a_good_call_works() -> None:
    x, w, bias = integer_case(3, 48, 64)
    with pytest.raises(RuntimeError, match="amx_linear_silu_and_mul: out_features .* multiple of 32, got 48"):
        ops().amx_linear_silu_and_mul(x, pack_weight(w), bias, 48)
    with pytest.raises(RuntimeError, match="amx_linear_silu_and_mul: x must be bfloat16"):
        ops().amx_linear_silu_and_mul(x.float(), pack_weight(w[:32]), None, 32)
    product = (x.double() @ w[:32].double().T).bfloat16()
    assert torch.equal(ops().amx_linear_silu_and_mul(x, pack_weight(w[:32]), None, 32),
                       F.silu(product[:, :16]) * product[:, 16:])
    checks = torch.library.opcheck(ops().amx_linear_silu_and_mul.default, (x, pack_weight(w[:32]), None, 32))
    assert set(checks.values()) == {"SUCCESS"}, checks


def rotary_tables(m: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [m, 1, head_dim] bf16 as RotaryCosSin lays them out (rotate-half; sin signed) for random angles."""
    angle = torch.rand(m, 1, head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 100
    return torch.cat([angle.cos()] * 2, -1).bfloat16(), torch.cat([-angle.sin(), angle.sin()], -1).bfloat16()


@needs_amx
@pytest.mark.parametrize("m", [1, 17, 70])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(3, 1, 64), (2, 1, 128), (2, 2, 32)])
def test_qkv_through_the_rotary_gives_torchs_rotation_of_the_exact_product(
    m: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    """A qkv product (q, k and v heads) whose q and k heads are rotated as they are stored: each is torch's rotate-half
    (x * cos, rounded, plus its partner times sin: RotaryCosSin's ops) of the exact sum rounded to bf16, v's outputs
    the exact sums, as amx_linear then rotary_embedding give."""
    n, rotary = (heads + 2 * kv_heads) * head_dim, (heads + kv_heads) * head_dim
    x, w, bias = integer_case(m, n, 128, seed=m + head_dim)
    packed = pack_weight(w)
    cos, sin = rotary_tables(m, head_dim, seed=m)
    for b in (bias, None):
        product = (x.double() @ w.double().T + (0 if b is None else b.double())).bfloat16()
        expected = product.clone()
        qk = expected[:, :rotary].view(m, heads + kv_heads, head_dim)
        qk.mul_(cos).addcmul_(product[:, :rotary].view_as(qk).roll(head_dim // 2, dims=-1), sin)
        got = amx_linear_rotary(x, packed, b, n, cos, sin, rotary, head_dim)
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
        two_calls = ops().amx_linear(x, packed, b, n)
        ops().rotary_embedding(two_calls[:, :rotary].view(m, heads + kv_heads, head_dim), cos, sin, True)
        assert torch.equal(got.view(torch.int16), two_calls.view(torch.int16))


@needs_amx
@pytest.mark.parametrize("args,named", [
    (lambda x, p, cos, sin: (x, p, None, 96, cos, sin, 48, 48), "head_dim must be a positive multiple of 32"),
    (lambda x, p, cos, sin: (x, p, None, 96, cos, sin, 80, 32), "rotary_columns a multiple of it"),
    (lambda x, p, cos, sin: (x, p, None, 96, cos, sin, 128, 32), "within out_features"),
    (lambda x, p, cos, sin: (x, p, None, 96, cos[:2], sin, 64, 32), "cos and sin must be contiguous bfloat16 .3, 32."),
    (lambda x, p, cos, sin: (x, p, None, 96, cos, sin.float(), 64, 32), "cos and sin must be contiguous bfloat16"),
])
def test_the_rotary_product_refuses_bad_arguments_by_name_then_a_good_call_works(args, named) -> None:
    x, w, bias = integer_case(3, 96, 64)
    packed, (cos, sin) = pack_weight(w), rotary_tables(3, 32, seed=1)
    with pytest.raises(RuntimeError, match=named):
        ops().amx_linear_rotary(*args(x, packed, cos, sin))
    expected = ops().amx_linear(x, packed, bias, 96)
    ops().rotary_embedding(expected[:, :64].view(3, 2, 32), cos, sin, True)
    assert torch.equal(ops().amx_linear_rotary(x, packed, bias, 96, cos, sin, 64, 32), expected)
    checks = torch.library.opcheck(ops().amx_linear_rotary.default, (x, packed, bias, 96, cos, sin, 64, 32))
    assert set(checks.values()) == {"SUCCESS"}, checks


def test_int8_codes_pack_four_k_to_a_word() -> None:
    """int8: tile (j, t) row p holds k = 64 t + 4 p .. + 3 of outputs 16 j .. 16 j + 15 (TDPBSSD's B layout)."""
    w = torch.randint(-127, 128, (40, 128), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    packed = pack_weight(w)
    assert packed.shape == (4, 2, 16, 64) and packed.dtype == torch.int8
    for j, t, p, c in [(0, 0, 0, 0), (1, 1, 5, 7), (2, 0, 15, 13), (0, 1, 3, 63)]:
        assert packed[j, t, p, c] == w[16 * j + c // 4, 64 * t + 4 * p + c % 4]
    assert not packed[2, :, :, 32:].any() and not packed[3].any()  # outputs 40..63: zero rows


@needs_amx
@pytest.mark.parametrize("args, named", [
    (lambda x, p, s: (x.half(), p, s, None, 48), "x must be bfloat16 or float32 \\[M, K\\], K a multiple of 64"),
    (lambda x, p, s: (x[:, :32], p, s, None, 48), "K a multiple of 64"),
    (lambda x, p, s: (x, p.float(), s, None, 48), "packed must be contiguous int8"),
    (lambda x, p, s: (x, p, s[:40], None, 48), "weight_scale must be contiguous float32 \\[48\\]"),
    (lambda x, p, s: (x, p, s, torch.zeros(47), 48), "bias must be \\[48\\]"),
])
def test_the_int8_kernel_refuses_bad_arguments_by_name_then_a_good_call_works(args, named) -> None:
    """Integer inputs whose per-row scale is 1 (each row's largest |x| is 127): the exact product, scaled."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-127, 128, (3, 64), generator=g).float()
    x[:, 0] = 127
    w = torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=g)
    packed, scale = pack_weight(w), torch.full((48,), 0.5)
    with pytest.raises(RuntimeError, match=named):
        ops().amx_int8_linear(*args(x, packed, scale))
    expected = (x.double() @ w.double().T) * 0.5
    assert torch.equal(ops().amx_int8_linear(x, packed, scale, None, 48), expected.float())


@needs_amx
def test_the_op_passes_torchs_opcheck_its_fake_included() -> None:
    x, w, bias = integer_case(3, 48, 64)
    checks = torch.library.opcheck(ops().amx_linear.default, (x, pack_weight(w), bias, 48))
    assert set(checks.values()) == {"SUCCESS"}, checks


@needs_amx
@pytest.mark.parametrize("planes", [1, 2])
def test_int4s_amx_path_gives_this_kernels_bits_on_the_decoded_weight(planes: int) -> None:
    """Both sum each output with TDPBF16PS over k in order, on the same bf16 weights (int4_matmul decodes them as
    Int4Groups.dequantize rounds them): on AMX, int4 decode computes exactly the dense layer of its weights."""
    g = torch.Generator().manual_seed(planes)
    n, k, group = 200, 608, 32
    q = torch.randint(0, 16, (planes, n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(planes, n, k // group, generator=g) * 0.01
    zero = torch.randn(planes, n, k // group, generator=g) * 0.01
    groups = Int4Groups(q, scale, zero, group)
    packed = pack_weight(groups.dequantize().bfloat16())
    int4 = NativeInt4.pack(groups, torch.bfloat16)
    x = torch.randn(64, k, generator=g).bfloat16()
    x[:, 0], x[:, -1] = 2.0**10, -(2.0**10)  # cancelling: another summation order shows in the bits
    for m in (1, 7, 16, 33, 64):
        assert torch.equal(int4.matmul(x[:m]), ops().amx_linear(x[:m], packed, None, n)), m


@pytest.mark.skipif(not native_available() or amx_linear_enabled(), reason="AMX runs here")
def test_without_amx_the_kernel_refuses_by_name() -> None:
    x, w, _ = integer_case(3, 48, 64)
    with pytest.raises(RuntimeError, match="AMX is not available here"):
        ops().amx_linear(x, pack_weight(w), None, 48)


def _method(options: LinearOptions) -> object:
    layer = ReplicatedLinear(64, 96, bias=True).bfloat16()
    for param in layer.parameters():
        param.weight_loader(param, torch.randn(param.shape).bfloat16())
    process_weights_after_loading(layer, options)
    return layer.quant_method


@needs_amx
def test_batch_invariant_bf16_layers_use_it_and_others_keep_onednn() -> None:
    method = _method(LinearOptions(int4=False, row_invariant=True))
    assert isinstance(method, AmxLinearMethod) and method.row_plan is None and not method.row_variant
    assert not isinstance(_method(LinearOptions(int4=False)), AmxLinearMethod)  # the mode off: oneDNN's one call


@needs_amx
@pytest.mark.parametrize("env", [{AMX_ENV: "0"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}])
def test_the_switch_and_an_isa_cap_below_amx_turn_it_off(env: dict[str, str]) -> None:
    """Read once per process (by the kernels, for the int4 kernel's AMX path too): checked in a fresh one."""
    probe = ("from llmplug.layers.kernels.amx_linear import amx_linear_enabled; "
             "print(amx_linear_enabled())")
    done = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.split() == ["False"], done.stderr[-2000:]
