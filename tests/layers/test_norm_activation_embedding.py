"""RMSNorm (with the fused residual add), SiluAndMul, the vocabulary embedding and the LM head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmplug.core.errors import ModelLoadError
from llmplug.layers.activation import SiluAndMul
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(x.dtype)


def test_rms_norm_matches_transformers() -> None:
    norm = RMSNorm(16, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 16)
    torch.testing.assert_close(norm(x), hf_rms_norm(x, norm.weight, 1e-5))


def test_fused_residual_add_returns_norm_of_sum_and_the_sum() -> None:
    norm = RMSNorm(16)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    expected_sum = x + residual
    out, new_residual = norm(x.clone(), residual)
    torch.testing.assert_close(new_residual, expected_sum)
    torch.testing.assert_close(out, hf_rms_norm(expected_sum, norm.weight, norm.variance_epsilon))


def test_silu_and_mul_is_swiglu() -> None:
    x = torch.randn(4, 10)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :5]) * x[:, 5:])


def test_embedding_and_untied_and_tied_heads() -> None:
    embed = VocabParallelEmbedding(10, 4)
    table = torch.randn(10, 4)
    embed.weight_loader(embed.weight, table)
    ids = torch.tensor([0, 9, 3])
    torch.testing.assert_close(embed(ids), table[ids])
    head = ParallelLMHead(10, 4)
    head.weight_loader(head.weight, torch.randn(10, 4))
    hidden = torch.randn(2, 4)
    torch.testing.assert_close(head.get_logits(hidden), hidden @ head.weight.T)
    tied = ParallelLMHead(10, 4).tie_weights(embed)
    assert tied.weight is embed.weight
    torch.testing.assert_close(tied.get_logits(hidden), hidden @ table.T)


def test_embedding_with_the_wrong_vocabulary_is_a_load_error() -> None:
    embed = VocabParallelEmbedding(10, 4)
    with pytest.raises(ModelLoadError, match=r"\(12, 4\)"):
        embed.weight_loader(embed.weight, torch.zeros(12, 4))
