"""RMSNorm in reduced precision rounds like transformers' LlamaRMSNorm (statistic in float32, one
rounding to the activations' dtype, then the weight), and never changes its input except by the
documented fused residual add."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.layernorm import RMSNorm


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_matches_transformers_to_one_rounding_step(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, eps=1e-5).to(dtype)
    norm.weight.data.copy_(torch.rand(576, generator=gen) + 0.5)
    x = (torch.randn(64, 576, generator=gen) * 3).to(dtype)
    out, expected = norm(x), hf_rms_norm(x, norm.weight, 1e-5)
    assert out.dtype == dtype
    # the float32 statistic may differ in its last bit from transformers' (sum of squares vs mean), which
    # can move a product across a rounding boundary: at most one step of the output dtype, and rarely
    ulp = torch.finfo(dtype).eps * expected.float().abs()
    assert bool(((out.float() - expected.float()).abs() <= ulp).all())
    assert (out != expected).float().mean() < 1e-3


def test_input_is_left_alone_and_the_residual_sum_is_in_place() -> None:
    norm = RMSNorm(32).to(torch.bfloat16)
    x, residual = torch.randn(5, 32, dtype=torch.bfloat16), torch.randn(5, 32, dtype=torch.bfloat16)
    before = x.clone()
    norm(x)
    assert torch.equal(x, before)
    expected_sum = x + residual
    out, summed = norm(x, residual)
    assert summed.data_ptr() == x.data_ptr() and torch.equal(summed, expected_sum)
    torch.testing.assert_close(out, hf_rms_norm(expected_sum, norm.weight, norm.variance_epsilon), rtol=0.02, atol=0.02)


def test_heads_of_a_strided_view_are_normalized_each() -> None:
    norm = RMSNorm(8)
    qkv = torch.randn(3, 4, 8)  # [T, heads, head_dim] like the q/k norm of a fused projection
    heads = qkv[:, :2]
    torch.testing.assert_close(norm(heads), hf_rms_norm(heads, norm.weight, norm.variance_epsilon))
