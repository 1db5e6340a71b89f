"""`llmplug_cpu::gguf_matmul`, GGUF-quantized weights computed from their raw blocks (llmplug.quantization.gguf),
and `llmplug_cpu::gguf_get_rows`, rows of such a table (an embedding lookup), against gguf-py's own dequantizer
(`gguf.quants.dequantize`, llama.cpp's reference in Python).

The blocks are random bytes with sane fp16 scales, so every bit pattern of the quants (and, for the IQ types, every
grid and sign index) is exercised. test_isa_caps runs this file under the generic x86-64-v2 build too.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmplug.layers.kernels.native import native_available, ops
from llmplug.quantization.gguf import IQ_TYPES, KERNEL_TYPES, lookup_tables, packed_rows

pytestmark = pytest.mark.skipif(not native_available(), reason="llmplug's CPU kernels cannot be built here")

Q = gguf.GGMLQuantizationType
TYPES = sorted(KERNEL_TYPES, key=int)
# the byte offsets of a block's fp16 fields: d, and the min's scale where the type has one (else d at 0)
_HALVES = {Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
           Q.Q6_K: (208,)}
_IQ1_M_SCALES = 48  # IQ1_M's d is the top nibbles of its four 16-bit scale words, from this byte on


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes] of random blocks of `qtype` whose fp16 scales are small positive numbers."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)

    def halves() -> np.ndarray:
        values = rng.uniform(0.001, 0.01, size=blocks.shape[:2]).astype(np.float16)
        return values.view(np.uint8).reshape(*blocks.shape[:2], 2)

    if qtype == Q.IQ1_M:
        words = blocks[..., _IQ1_M_SCALES:].copy().view(np.uint16)  # [rows, blocks, 4]
        d = halves().view(np.uint16)  # [rows, blocks, 1]
        nibbles = (d >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 0xF  # nibble i of d tops word i
        blocks[..., _IQ1_M_SCALES:] = ((words & 0x0FFF) | (nibbles << 12)).view(np.uint8)
        return blocks.reshape(rows, -1)
    for offset in _HALVES.get(qtype, (0,)):
        blocks[..., offset : offset + 2] = halves()
    return blocks.reshape(rows, -1)


def reference_weight(blocks: np.ndarray, qtype: Q, cols: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(blocks.shape[0], cols))


def gguf_matmul(x: torch.Tensor, blocks: np.ndarray | torch.Tensor, qtype: Q) -> torch.Tensor:
    """The kernel with `qtype`'s tables from gguf-py, as llmplug.quantization.gguf calls it."""
    w = blocks if isinstance(blocks, torch.Tensor) else torch.from_numpy(blocks)
    return ops().gguf_matmul(x, w, int(qtype), list(lookup_tables(qtype)))


def test_random_iq1_m_blocks_have_the_chosen_scale() -> None:
    blocks = random_blocks(Q.IQ1_M, 2, 512)
    weight = reference_weight(blocks, Q.IQ1_M, 512)
    # |w| = d (2 sc + 1) |grid +- 1/8| <= 0.01 * 15 * 1.125: d assembled from the nibbles as gguf-py reads it
    assert torch.isfinite(weight).all() and 0 < weight.abs().max() <= 0.01 * 15 * 1.125


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_kernel_equals_x_times_gguf_py_dequantized_weight(qtype: Q, dtype: torch.dtype) -> None:
    rows, cols = 42, 512  # 42: tiles of 4 rows and a last one of 2
    blocks = random_blocks(qtype, rows, cols)
    weight = reference_weight(blocks, qtype, cols)
    for m in (1, 4, 33):
        x = torch.randn(m, cols).to(dtype)
        y = gguf_matmul(x, blocks, qtype)
        expected = x.float() @ weight.T
        assert y.dtype == dtype and y.shape == (m, rows)
        scale = expected.abs().max()
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
        assert (y.float() - expected).abs().max() <= tolerance * scale


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_kernels_weights_are_gguf_pys_bit_for_bit(qtype: Q) -> None:
    blocks = random_blocks(qtype, 8, 512, seed=3)
    decoded = gguf_matmul(torch.eye(512), blocks, qtype)  # x = I: y = W^T, exactly
    assert torch.equal(decoded.T, reference_weight(blocks, qtype, 512))


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0, *sorted(IQ_TYPES, key=int)],
                         ids=lambda q: q.name)
def test_each_output_row_is_bitwise_the_same_whatever_the_number_of_rows(qtype: Q) -> None:
    blocks = torch.from_numpy(random_blocks(qtype, 26, 768, seed=1))  # 26: a last tile of 2 rows
    x = torch.randn(33, 768)
    alone = torch.cat([gguf_matmul(x[i : i + 1], blocks, qtype) for i in range(33)])
    for m in range(1, 34):
        assert torch.equal(gguf_matmul(x[:m], blocks, qtype), alone[:m]), m


def test_a_type_the_kernel_lacks_and_a_wrong_row_size_are_refused() -> None:
    with pytest.raises(RuntimeError, match="not implemented"):
        ops().gguf_matmul(torch.randn(1, 256), torch.zeros(4, 54, dtype=torch.uint8), int(Q.TQ1_0), [])
    with pytest.raises(RuntimeError, match="bytes a row"):
        ops().gguf_matmul(torch.randn(1, 512), torch.zeros(4, 144, dtype=torch.uint8), int(Q.Q4_K), [])


def test_an_iq_type_without_its_tables_or_with_a_wrong_grid_is_refused() -> None:
    x, blocks = torch.randn(1, 256), torch.from_numpy(random_blocks(Q.IQ2_XXS, 4, 256))
    grid, signs = lookup_tables(Q.IQ2_XXS)
    with pytest.raises(RuntimeError, match="takes 2 lookup tables, got 0"):
        ops().gguf_matmul(x, blocks, int(Q.IQ2_XXS), [])
    with pytest.raises(RuntimeError, match="the grid must be 2048 contiguous int8"):
        ops().gguf_matmul(x, blocks, int(Q.IQ2_XXS), [grid[:1024], signs])
    with pytest.raises(RuntimeError, match="ksigns must be 128 contiguous uint8"):
        ops().gguf_matmul(x, blocks, int(Q.IQ2_XXS), [grid, signs.to(torch.int8)])


# ---------------------------------------------------------------- gguf_get_rows: rows of a packed table


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_looked_up_rows_are_gguf_pys_dequantized_rows_bit_for_bit_in_each_dtype(qtype: Q) -> None:
    blocks = random_blocks(qtype, 12, 512, seed=5)
    weight = reference_weight(blocks, qtype, 512)
    ids = torch.tensor([[3, 0, 11], [3, 7, 1]])  # any shape of ids, a row twice
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = packed_rows(torch.from_numpy(blocks), qtype, ids, dtype)
        assert rows.dtype == dtype and rows.shape == (2, 3, 512)
        assert torch.equal(rows, weight[ids].to(dtype)), dtype  # torch's rounding of gguf-py's float32 weights
    assert torch.equal(packed_rows(torch.from_numpy(blocks), qtype, ids.int(), torch.float32), weight[ids])


def test_a_row_looked_up_alone_equals_it_in_a_batch() -> None:
    blocks = torch.from_numpy(random_blocks(Q.Q6_K, 64, 768, seed=2))
    ids = torch.randint(0, 64, (40,))
    batch = packed_rows(blocks, Q.Q6_K, ids, torch.float32)
    assert torch.equal(torch.cat([packed_rows(blocks, Q.Q6_K, ids[i : i + 1], torch.float32) for i in range(40)]),
                       batch)


def test_an_id_outside_the_table_or_a_wrong_output_is_refused_and_the_next_lookup_works() -> None:
    blocks = torch.from_numpy(random_blocks(Q.Q8_0, 4, 64))
    out = torch.empty(1, 64)
    for bad in (4, -1):
        with pytest.raises(RuntimeError, match=f"id {bad} is outside the table's 4 rows"):
            ops().gguf_get_rows(blocks, torch.tensor([bad]), int(Q.Q8_0), [], out)
    with pytest.raises(RuntimeError, match=r"out must be \[1, 64\]"):
        ops().gguf_get_rows(blocks, torch.tensor([0]), int(Q.Q8_0), [], torch.empty(1, 32))
    with pytest.raises(RuntimeError, match="takes 1 lookup tables, got 0"):
        ops().gguf_get_rows(blocks, torch.tensor([0]), int(Q.IQ4_NL), [], out)
    ops().gguf_get_rows(blocks, torch.tensor([3]), int(Q.Q8_0), [], out)
    assert torch.equal(out, reference_weight(blocks.numpy(), Q.Q8_0, 64)[3:])
