"""The row-wise kernels equal their torch references under triton's interpreter: KV-cache write, RMSNorm
with and without the fused residual add, rotary (neox and interleaved, partial), SiLU-and-mul, and the
guided-decoding bitmask."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.kernels.activation import silu_and_mul
from llmplug.layers.kernels.bitmask import apply_token_bitmask_
from llmplug.layers.kernels.reference import (
    reshape_and_cache_ref,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_ref,
    token_bitmask_ref,
)
from llmplug.layers.kernels.reshape_and_cache import reshape_and_cache
from llmplug.layers.kernels.rms_norm import rms_norm
from llmplug.layers.kernels.rotary import rotary_embedding_


@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_writes_each_token_at_its_slot(block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    kv_heads, d, num_blocks, tokens = 2, 24, 6, 40
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * d, generator=gen)  # k and v as strided slices of qkv
    k, v = qkv[:, 4 * d : (4 + kv_heads) * d], qkv[:, (4 + kv_heads) * d :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, d)
    expected = cache.clone()
    reshape_and_cache(k, v, cache[0], cache[1], slots)
    reshape_and_cache_ref(k, v, expected[0], expected[1], slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("width", [64, 100])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(width: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=gen)
    residual = torch.randn(7, width, generator=gen) if with_residual else None
    weight = torch.rand(width, generator=gen) + 0.5
    expected, summed = rms_norm_ref(x.clone(), weight, 1e-6, residual)
    out = rms_norm(x, weight, 1e-6, residual)
    assert (out - expected).abs().max() < 1e-5
    if with_residual:  # the sum replaces x, as the decoder layer expects
        assert (x - summed).abs().max() < 1e-6


def test_rms_norm_bf16_matches_the_upcast_reference_within_a_bf16_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=gen).bfloat16()
    residual = torch.randn(5, 96, generator=gen).bfloat16()
    weight = (torch.rand(96, generator=gen) + 0.5).bfloat16()
    expected, summed = rms_norm_ref(x.clone(), weight, 1e-5, residual)
    out = rms_norm(x, weight, 1e-5, residual)
    # the interpreter converts float32 to bf16 by truncation (a GPU rounds to nearest): allow one bf16 step
    assert ((x.float() - summed.float()).abs() <= summed.float().abs() * 2**-7).all()
    assert ((out.float() - expected).abs() <= expected.abs() * 2**-6 + 1e-3).all()


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
def test_rotary_matches_reference(neox: bool, rotary_dim: int) -> None:
    gen = torch.Generator().manual_seed(rotary_dim + neox)
    tokens, heads, d, max_pos = 9, 6, 32, 64
    angles = torch.rand(max_pos, rotary_dim // 2, generator=gen) * 6
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2) * d, generator=gen)
    x = qkv[:, : heads * d].view(tokens, heads, d)  # strided along tokens, like q and k inside qkv
    expected = rotary_ref(x, positions, cache, neox)
    rotary_embedding_(x, positions, cache, neox)
    assert (x - expected).abs().max() < 1e-5


def test_silu_and_mul_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2 * 1100, generator=gen)  # d = 1100 spans two column blocks
    assert (silu_and_mul(x) - silu_and_mul_ref(x)).abs().max() < 1e-5


def test_token_bitmask_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 1100  # two token blocks; the bitmask covers 32 * 34 = 1088 tokens: the last 12 are disallowed
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 34), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # a row that allows everything the bitmask covers
    logits = torch.randn(4, vocab, generator=gen)
    expected = token_bitmask_ref(logits, bitmask)
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)
    assert bool(torch.isneginf(logits[1, 1088:]).all()) and not bool(torch.isneginf(logits[1, :1088]).any())
