"""get_rope computes what transformers computes: inverse frequencies of every scaling type (checked
against transformers' own ROPE_INIT_FUNCTIONS) and the rotation of q and k."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.nanochat.modeling_nanochat import apply_rotary_pos_emb as nanochat_rotary

from llmplug.layers.rotary import get_rope, rope_inv_freq

HEAD_DIM, MAX_POS, THETA = 64, 512, 10000.0

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_mscale": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
    },
    "yarn_no_factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 128},
}


def hf_config(scaling: dict | None) -> LlamaConfig:
    params = {"rope_theta": THETA, **(scaling or {"rope_type": "default"})}
    return LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS, rope_parameters=params,
    )


def angles_table(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) halves of a cos_sin_cache [L, rotary_dim]."""
    half = cache.shape[-1] // 2
    return cache[:, :half], cache[:, half:]


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_inverse_frequencies_match_transformers(name: str) -> None:
    scaling = SCALINGS[name]
    expected, expected_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config(scaling), "cpu")
    inv_freq, factor = rope_inv_freq(THETA, HEAD_DIM, scaling, MAX_POS)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_cos_sin_table_is_scaled_like_transformers(name: str) -> None:
    scaling = SCALINGS[name]
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config(scaling), "cpu")
    cos, sin = angles_table(get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, scaling).cos_sin_cache)
    positions = torch.arange(cos.shape[0], dtype=torch.float32)[:, None]
    torch.testing.assert_close(cos, (positions * inv_freq).cos() * factor, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, (positions * inv_freq).sin() * factor, rtol=0, atol=1e-5)


def test_dynamic_ntk_rows_use_the_base_for_their_sequence_length() -> None:
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    config = hf_config(scaling)
    cache = get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, scaling).cos_sin_cache
    assert cache.shape[0] == 2 * MAX_POS
    cos, _ = angles_table(cache)
    for position in (0, 100, MAX_POS - 1, MAX_POS, MAX_POS + 300, 2 * MAX_POS - 1):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=position + 1)
        torch.testing.assert_close(cos[position], (position * inv_freq).cos(), rtol=0, atol=1e-5)


def test_default_rope_table_covers_max_position() -> None:
    cos, sin = angles_table(get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, THETA).cos_sin_cache)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](hf_config({"rope_type": "linear", "factor": 1.0}), "cpu")
    assert cos.shape == (MAX_POS, HEAD_DIM // 2)
    torch.testing.assert_close(sin[7], (7 * inv_freq).sin(), rtol=0, atol=1e-6)


def test_rotation_matches_transformers_apply_rotary_pos_emb() -> None:
    rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, THETA)
    positions = torch.tensor([0, 3, 77, 200, 5])
    q, k = torch.randn(5, 4 * HEAD_DIM), torch.randn(5, 2 * HEAD_DIM)
    q_rot, k_rot = rope(positions, q, k)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](hf_config({"rope_type": "linear", "factor": 1.0}), "cpu")
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    q_heads, k_heads = q.view(1, 5, 4, HEAD_DIM).transpose(1, 2), k.view(1, 5, 2, HEAD_DIM).transpose(1, 2)
    hf_q, hf_k = apply_rotary_pos_emb(q_heads, k_heads, emb.cos()[None], emb.sin()[None])
    torch.testing.assert_close(q_rot, hf_q.transpose(1, 2).reshape(5, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(k_rot, hf_k.transpose(1, 2).reshape(5, -1), rtol=0, atol=1e-5)


def test_partial_and_interleaved_rotation() -> None:
    """Only the first rotary_dim dims turn; interleaved style pairs dims (2i, 2i + 1)."""
    rope = get_rope(HEAD_DIM, 32, MAX_POS, THETA, is_neox_style=False)
    positions = torch.tensor([0, 9, 31])
    q = torch.randn(3, HEAD_DIM)
    q_rot, _ = rope(positions, q, q.clone())
    torch.testing.assert_close(q_rot[:, 32:], q[:, 32:], rtol=0, atol=0)
    inv_freq = 1.0 / THETA ** (torch.arange(0, 32, 2).float() / 32)
    angle = positions[:, None].float() * inv_freq
    even, odd = q[:, 0:32:2], q[:, 1:32:2]
    torch.testing.assert_close(q_rot[:, 0:32:2], even * angle.cos() - odd * angle.sin(), rtol=0, atol=1e-5)
    torch.testing.assert_close(q_rot[:, 1:32:2], odd * angle.cos() + even * angle.sin(), rtol=0, atol=1e-5)


def test_unknown_scaling_type_is_refused() -> None:
    with pytest.raises(ValueError, match="made_up"):
        get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, {"rope_type": "made_up", "factor": 2.0})


@pytest.mark.parametrize("original", [MAX_POS // 4, MAX_POS])
def test_longrope_uses_the_factors_transformers_uses_for_a_sequence_of_the_whole_context(original: int) -> None:
    """Long factors when the context exceeds the original one (transformers: for a longer sequence), else short."""
    half = HEAD_DIM // 2
    scaling = {
        "rope_type": "longrope", "original_max_position_embeddings": original,
        "short_factor": torch.linspace(1.0, 1.5, half).tolist(), "long_factor": torch.linspace(1.0, 9.0, half).tolist(),
    }
    expected, expected_factor = ROPE_INIT_FUNCTIONS["longrope"](hf_config(scaling), "cpu", seq_len=MAX_POS)
    inv_freq, factor = rope_inv_freq(THETA, HEAD_DIM, scaling, MAX_POS)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor) and (factor > 1.0) == (original < MAX_POS)


def test_inverted_rotation_matches_nanochats_flipped_rotate_half() -> None:
    """NanoChat rotates with rotate_half(x) = [x2, -x1]: by minus the angle."""
    rope = get_rope(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, inverted=True)
    positions = torch.tensor([0, 3, 77])
    q, k = torch.randn(3, 2 * HEAD_DIM), torch.randn(3, HEAD_DIM)
    q_rot, k_rot = rope(positions, q, k)
    inv_freq = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angle = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)[None]  # [1, T, D]
    heads = lambda t: t.view(1, 3, -1, HEAD_DIM).transpose(1, 2)  # noqa: E731
    hf_q, hf_k = nanochat_rotary(heads(q), heads(k), angle.cos(), angle.sin())
    torch.testing.assert_close(q_rot, hf_q.transpose(1, 2).reshape(3, -1), rtol=0, atol=1e-5)
    torch.testing.assert_close(k_rot, hf_k.transpose(1, 2).reshape(3, -1), rtol=0, atol=1e-5)
