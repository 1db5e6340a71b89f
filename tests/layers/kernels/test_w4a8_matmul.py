"""`llmplug_cpu::w4a8_matmul` through `W4A8`: GGUF Q4_0 / Q4_1 blocks times int8 activations (llama.cpp's Q8_1
rule), checked against an independent emulation of the documented arithmetic in torch (each float32 rounding made
explicitly), bit for bit, and against the float64 product of the quantized rows and the blocks' weights.

Every path of the kernel -- AMX tiles (8 rows and more where AMX runs), AVX512-VNNI or AVX-512 (fewer rows, or no
AMX), the generic loop (tests/engine/test_isa_caps.py runs this file under -march=x86-64-v2 and every oneDNN ISA
cap) -- must give those same bits: that is what makes a row's result independent of its batch and of the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmplug.layers.kernels.amx_linear import AMX_ENV
from llmplug.layers.kernels.native import native_available, ops
from llmplug.layers.kernels.w4a8 import W4A8
from llmplug.layers.quantization import Int4Groups

pytestmark = pytest.mark.skipif(not native_available(), reason="llmplug's CPU kernels cannot be built here")

ROOT = Path(__file__).resolve().parents[3]


def gguf_groups(kind: str, n: int, k: int, seed: int = 0, group_size: int = 32) -> Int4Groups:
    """One plane as the GGUF loader decodes Q4_0 (zero 8 d) or Q4_1 (zero m + 8 d) blocks: float16 d and m."""
    generator = torch.Generator().manual_seed(seed)
    d = ((torch.randn(n, k // group_size, generator=generator) * 0.01).abs() + 2.0**-14).half().float()
    q = torch.randint(0, 16, (1, n, k), generator=generator, dtype=torch.uint8)
    m = (torch.randn(n, k // group_size, generator=generator) * 0.05).half().float() if kind == "Q4_1" else -8 * d
    return Int4Groups(q, d[None], (m + 8 * d)[None], group_size)


def rows(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Activation-like rows: mostly small, a few large values (an int8 block's scale follows its largest)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator)
    x[:, ::37] *= 20
    return x.to(dtype)


def quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [M, K], scales dx and code sums sx [M, K / 32], each 32 k as Q8_1: dx = max |x| / 127, codes
    round(x * (1 / dx)) to nearest even, all in float32 (codes 0 where dx is not a normal float)."""
    blocks = x.float().unflatten(-1, (-1, 32))
    dx = blocks.abs().amax(-1) / 127
    inverse = torch.where(dx >= torch.finfo(torch.float32).tiny, 1 / dx, torch.zeros_like(dx))
    codes = torch.round(blocks * inverse[..., None]).clamp(-127, 127)
    return codes.flatten(-2), dx, codes.sum(-1)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c with one rounding: the product is exact in float64, the sum rounds there first (a second
    rounding that could differ from a fused one only at a float32 tie; not met by these cases)."""
    return (a.double() * b.double() + c.double()).float()


def emulated(x: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    """The kernel's documented arithmetic: for each block in k order, t = fma(dot, d, sx * m),
    acc = fma(t, dx, acc), from +0; then rounded to x's dtype."""
    codes, dx, sx = quantized_rows(x)
    q = groups.q[0].double()  # [N, K]
    d = groups.scale[0].repeat_interleave(groups.group_size // 32, dim=1)  # [N, K / 32]
    m = (groups.zero[0] - 8 * groups.scale[0]).repeat_interleave(groups.group_size // 32, dim=1)
    acc = torch.zeros(x.shape[0], q.shape[0])
    for b in range(q.shape[1] // 32):
        k = slice(32 * b, 32 * b + 32)
        dot = (codes[:, k].double() @ q[:, k].T).float()  # exact integers
        t = fma32(dot, d[:, b][None], sx[:, b, None] * m[:, b][None])
        acc = fma32(t, dx[:, b, None], acc)
    return acc.to(x.dtype)


SHAPES = [(576, 576), (192, 1536), (40, 64), (37, 96), (200, 608)]  # N not a multiple of 16: a partial group
ROW_COUNTS = [1, 2, 3, 4, 7, 8, 9, 16, 17, 33]  # the vector path, the AMX path's row tiles and their remainders


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("n, k", SHAPES)
def test_kernel_computes_the_documented_arithmetic_bit_for_bit(n: int, k: int, kind: str, dtype: torch.dtype):
    groups = gguf_groups(kind, n, k, seed=n + k)
    packed = W4A8.pack(groups)
    assert packed is not None
    for m in ROW_COUNTS:
        x = rows(m, k, dtype, seed=m)
        y = packed.matmul(x)
        assert y.dtype == dtype and y.shape == (m, n)
        assert torch.equal(y, emulated(x, groups)), (m, (y.double() - emulated(x, groups).double()).abs().max())


def test_kernel_is_the_quantized_rows_times_the_blocks_weights():
    """Against float64: the rows as their int8 blocks give them, times Int4Groups.dequantize(); the float32 steps
    (three roundings a block) and the output's rounding bound the difference."""
    groups = gguf_groups("Q4_1", 96, 1536, seed=5, group_size=64)  # a group of two blocks
    packed = W4A8.pack(groups)
    x = rows(9, 1536, torch.float32, seed=2)
    codes, dx, _ = quantized_rows(x)
    xq = (codes.double().unflatten(-1, (-1, 32)) * dx.double()[..., None]).flatten(-2)
    weight = groups.dequantize().double()
    expected = xq @ weight.T
    bound = 4 * 48 * 2.0**-24 * (xq.abs() @ weight.abs().T)
    assert ((packed.matmul(x).double() - expected).abs() <= bound).all()
    # and close to the unquantized product: the activations' rounding (at most half a code a value)
    assert torch.allclose(packed.matmul(x).double(), x.double() @ weight.T, rtol=0.05, atol=0.05 * expected.std())


def test_each_row_is_bitwise_the_same_whatever_the_number_of_rows_or_threads():
    packed = W4A8.pack(gguf_groups("Q4_1", 200, 608, seed=3))
    x = rows(130, 608, torch.bfloat16, seed=4)
    alone = torch.cat([packed.matmul(x[i : i + 1]) for i in range(x.shape[0])])
    for m in [*range(1, 41), 64, 65, 130]:
        assert torch.equal(packed.matmul(x[:m]), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(packed.matmul(x), alone), count
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_nan_and_zero_blocks():
    packed = W4A8.pack(gguf_groups("Q4_1", 48, 96, seed=1))
    x = rows(12, 97, torch.bfloat16)[:, :96]  # rows 97 apart
    assert torch.equal(packed.matmul(x), packed.matmul(x.contiguous()))
    x = rows(10, 96, torch.bfloat16)
    x[0, :32] = 0  # a zero block adds nothing
    x[0, 32:64] *= 2.0**-128  # a block too small for its scale's inverse: codes 0 on every path
    x[1, 40] = float("nan")  # a NaN or an infinity makes every output of its row NaN, and no other row's
    x[2, 70] = float("inf")
    groups = gguf_groups("Q4_1", 48, 96, seed=1)
    for y in (packed.matmul(x), packed.matmul(x.float()).bfloat16()):
        assert y[1].isnan().all() and y[2].isnan().all()
        assert torch.equal(y[0], emulated(x[:1], groups)[0]) and torch.equal(y[3:], emulated(x[3:], groups))
    assert packed.matmul(x[:0]).shape == (0, 48)


def test_packing_takes_gguf_blocks_only_and_its_views_are_d_and_m():
    groups = gguf_groups("Q4_1", 40, 64)
    packed = W4A8.pack(groups)
    assert packed.packed.shape == (3, 2, 320) and packed.out_features == 40
    d = packed.scales.transpose(1, 2).reshape(48, 2)[:40].float()  # [N, blocks]
    m = packed.zeros.transpose(1, 2).reshape(48, 2)[:40].float()
    assert torch.equal(d, groups.scale[0]) and torch.equal(m, groups.zero[0] - 8 * groups.scale[0])
    two_planes = Int4Groups(groups.q.repeat(2, 1, 1), groups.scale.repeat(2, 1, 1), groups.zero.repeat(2, 1, 1), 32)
    assert W4A8.pack(two_planes) is None  # Q8_0's planes: the bf16 kernel's
    wide = Int4Groups(groups.q, groups.scale + 2.0**-20, groups.zero, 32)
    assert W4A8.pack(wide) is None  # d not a float16
    assert W4A8.pack(Int4Groups(groups.q[:, :, :48], groups.scale[:, :, :3], groups.zero[:, :, :3], 16)) is None


def _good() -> tuple[torch.Tensor, torch.Tensor]:
    return rows(2, 64, torch.bfloat16), W4A8.pack(gguf_groups("Q4_1", 40, 64)).packed


@pytest.mark.parametrize("args, named", [
    (lambda x, p: (x[0], p, 40), "x must be \\[M, K\\]"),
    (lambda x, p: (x.half(), p, 40), "x must be float32 or bfloat16"),
    (lambda x, p: (x, p.view(torch.int8), 40), "packed must be contiguous uint8"),
    (lambda x, p: (x, p[..., :256].contiguous(), 40), "packed must be contiguous uint8 \\[N / 16, K / 32, 320\\]"),
    (lambda x, p: (x[:, :32], p, 40), "x has 32 columns, the packed weight holds 64"),
    (lambda x, p: (x, p, 49), "out_features 49 does not fit 3 groups of 16 columns"),
    (lambda x, p: (x, p, 32), "out_features 32 does not fit 3 groups of 16 columns"),
])
def test_bad_arguments_are_refused_by_name_then_a_good_call_works(args, named):
    x, packed = _good()
    with pytest.raises(RuntimeError, match=named):
        ops().w4a8_matmul(*args(x, packed))
    assert ops().w4a8_matmul(x, packed, 40).shape == (2, 40)


def test_the_op_passes_torchs_opcheck_its_fake_included():
    x, packed = _good()
    checks = torch.library.opcheck(ops().w4a8_matmul.default, (x, packed, 40))
    assert set(checks.values()) == {"SUCCESS"}, checks


def vector_path_outputs(path: str) -> None:
    """test_kernel_computes_...'s outputs for Q4_1 bf16, saved to `path` (run with AMX off by the test below)."""
    outputs = {}
    for n, k in SHAPES:
        packed = W4A8.pack(gguf_groups("Q4_1", n, k, seed=n + k))
        outputs[n, k] = [packed.matmul(rows(m, k, torch.bfloat16, seed=m)) for m in ROW_COUNTS]
    torch.save(outputs, path)


def test_amx_off_gives_the_same_bits(tmp_path: Path):
    """LLMPLUG_CPU_AMX=0 (read once per process: a subprocess) sends every row count down the vector path; its
    outputs are this process's (AMX from 8 rows where AMX runs) bit for bit."""
    path = tmp_path / "off.pt"
    code = f"from tests.layers.kernels.test_w4a8_matmul import vector_path_outputs; vector_path_outputs({str(path)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, AMX_ENV: "0"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    off = torch.load(path)
    for n, k in SHAPES:
        packed = W4A8.pack(gguf_groups("Q4_1", n, k, seed=n + k))
        for m, y in zip(ROW_COUNTS, off[n, k]):
            assert torch.equal(packed.matmul(rows(m, k, torch.bfloat16, seed=m)), y), (n, k, m)
