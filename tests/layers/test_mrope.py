"""M-RoPE (layers/mrope.py) rotates q and k as transformers' Qwen2-VL rotary (interleaved: Qwen3-VL's) does, for
positions that differ on the three streams; positions [T] are plain RoPE; a prompt's positions follow its images'
grids."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2VLTextConfig, Qwen3VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from llmplug.layers.mrope import get_mrope, mrope_input_positions
from llmplug.layers.rotary import get_rope

HEAD_DIM, HEADS, SECTION, THETA = 32, 2, [4, 6, 6], 10000.0


@pytest.mark.parametrize("scaling", [{"rope_type": "default"}, {"rope_type": "linear", "factor": 2.0}],
                         ids=["plain", "linear"])
def test_rotation_equals_transformers_qwen2_vl_rotary(scaling):
    config = Qwen2VLTextConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, max_position_embeddings=128,
                               rope_parameters={**scaling, "mrope_section": SECTION, "rope_theta": THETA})
    torch.manual_seed(0)
    positions = torch.randint(0, 128, (3, 7))  # each stream its own positions
    q, k = torch.randn(1, HEADS, 7, HEAD_DIM), torch.randn(1, HEADS, 7, HEAD_DIM)
    cos, sin = Qwen2VLRotaryEmbedding(config)(q, positions[:, None])
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    table_scaling = None if scaling["rope_type"] == "default" else scaling
    rope = get_mrope(HEAD_DIM, HEAD_DIM, 128, THETA, SECTION, table_scaling).cos_sin(positions, torch.float32)
    qk = torch.cat([q[0].transpose(0, 1), k[0].transpose(0, 1)], dim=1)  # [T, 2 * heads, D]
    rope.apply_(qk)
    torch.testing.assert_close(qk[:, :HEADS], expected_q[0].transpose(0, 1))
    torch.testing.assert_close(qk[:, HEADS:], expected_k[0].transpose(0, 1))


def test_positions_of_one_stream_are_plain_rope():
    positions = torch.arange(5, 12)
    mrope = get_mrope(HEAD_DIM, HEAD_DIM, 64, THETA, SECTION)
    plain = get_rope(HEAD_DIM, HEAD_DIM, 64, THETA)
    for given in (positions, positions.expand(3, -1)):
        torch.testing.assert_close(mrope.cos_sin(given, torch.float32).cos, plain.cos_sin(positions, torch.float32).cos)


def test_prompt_positions_follow_the_image_grids():
    # 2 text tokens, a 1 x 2 x 3 image, 1 text token, a 1 x 2 x 2 image, 2 text tokens
    positions, delta = mrope_input_positions(16, [(2, 6, (1, 2, 3)), (9, 4, (1, 2, 2))])
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert positions[:, 8].tolist() == [5, 5, 5]  # the image's start plus its largest side
    assert positions[:, 9:13].tolist() == [[6] * 4, [6, 6, 7, 7], [6, 7, 6, 7]]
    assert positions[:, 13:].tolist() == [[8, 9, 10]] * 3
    assert delta == 11 - 16
    with pytest.raises(ValueError, match="does not fit a 1x2x2 grid"):
        mrope_input_positions(16, [(2, 5, (1, 2, 2))])


def test_interleaved_rotation_equals_transformers_qwen3_vl_rotary():
    config = Qwen3VLTextConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, head_dim=HEAD_DIM,
                               max_position_embeddings=128,
                               rope_parameters={"rope_type": "default", "mrope_section": SECTION,
                                                "mrope_interleaved": True, "rope_theta": THETA})
    torch.manual_seed(0)
    positions = torch.randint(0, 128, (3, 7))
    q, k = torch.randn(1, HEADS, 7, HEAD_DIM), torch.randn(1, HEADS, 7, HEAD_DIM)
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(q, positions[:, None])
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    rope = get_mrope(HEAD_DIM, HEAD_DIM, 128, THETA, SECTION, interleaved=True).cos_sin(positions, torch.float32)
    qk = torch.cat([q[0].transpose(0, 1), k[0].transpose(0, 1)], dim=1)
    rope.apply_(qk)
    torch.testing.assert_close(qk[:, :HEADS], expected_q[0].transpose(0, 1))
    torch.testing.assert_close(qk[:, HEADS:], expected_k[0].transpose(0, 1))
