"""Qwen3-VL against transformers on a tiny random checkpoint and drawn pictures of two sizes, one and two per
prompt: greedy tokens equal and log-probabilities within 1e-4 (float32), plain and under chunked prefill whose
budget is smaller than one image (the deepstack rows follow the chunks), tensor parallel (2 ranks), and a
prefix-cache hit for the same image and a miss for another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.multimodal.conftest import TinyVLM, model_runner
from tests.multimodal.test_qwen2_vl import MAX_TOKENS, ONE, TEXT, TWO, qwen_tokenizer, save_with_processor


def save_tiny(path: Path) -> TinyVLM:
    """A 3-layer tower on 4-pixel patches merged 2x2 with a 4x4 table of learned positions and deepstack after
    its first two layers, a 2-layer Qwen3 decoder with interleaved M-RoPE; the processor as Qwen2-VL's test's."""
    import transformers

    tokenizer, ids = qwen_tokenizer(path / "tokenizer")
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=None,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True,
                                 "rope_theta": 10000.0})
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1])
    config = transformers.Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers' init leaves the tiny mergers' rows small: make the pictures matter
        visual = model.model.visual
        for merger in [visual.merger, *visual.deepstack_merger_list]:
            merger.linear_fc2.weight.normal_(0, 0.5)
        visual.pos_embed.weight.normal_(0, 1.0)
        for name, param in model.model.language_model.layers.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0, 0.2)
    return save_with_processor(path, model, tokenizer)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyVLM:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3_vl"))


@pytest.fixture(scope="module")
def case(tiny, images) -> MultimodalParityCase:
    """One and two pictures a prompt and a text prompt; chunks of 16 tokens: each image's 40 or 48 placeholders, and
    their deepstack rows, span 3 or 4 steps."""
    g, s = images["gradient"], images["shapes"]
    prompts = (MultimodalPrompt(ONE, (g,)), MultimodalPrompt(ONE, (s,)), MultimodalPrompt(TWO, (g, s)),
               MultimodalPrompt(TEXT))
    return MultimodalParityCase("Qwen3VLForConditionalGeneration", tiny.path, tiny.processor, tiny.hf_model, prompts,
                                chunk_budget=16, max_tokens=MAX_TOKENS)


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(mm_parity, case):
    with mm_parity.engine(case) as llm:
        assert type(model_runner(llm).model).__name__ == case.name
        assert model_runner(llm).model.deepstack_layers == 2
        mm_parity.check(case, "plain", llm)
        mm_parity.check_prefix_cache(case, llm)


@pytest.mark.parametrize("variant", ["chunked_prefill", "tp2"])
def test_chunked_prefill_smaller_than_an_image_and_tensor_parallel_match_transformers(mm_parity, case, variant):
    """chunked_prefill: the deepstack rows follow the chunks; tp2: each rank runs its half of the tower's heads and
    MLP, of the mergers' features and of the decoder, chunked inside the images."""
    mm_parity.check(case, variant)
