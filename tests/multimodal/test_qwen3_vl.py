"""Qwen3-VL against transformers on a tiny random checkpoint and drawn pictures of two sizes, one and two per
prompt: greedy tokens equal and log-probabilities within 1e-4 (float32), plain and under chunked prefill whose
budget is smaller than one image (the deepstack rows follow the chunks), and a prefix-cache hit for the same
image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.test_qwen2_vl import (
    ONE, SPECIAL_TOKENS, TEXT, TOKENS, TWO, TinyQwenVL, assert_matches_hf, greedy, make_llm, runner,
)

DEVICE = {"num_threads": 1}


def save_tiny(path: Path) -> TinyQwenVL:
    """A 3-layer tower on 4-pixel patches merged 2x2 with a 4x4 table of learned positions and deepstack after
    its first two layers, a 2-layer Qwen3 decoder with interleaved M-RoPE; the processor as Qwen2-VL's test's."""
    import transformers
    from transformers import LlamaTokenizer, PaddleOCRVLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    train_llama_tokenizer(path / "tokenizer").save_pretrained(path / "tokenizer")
    tokenizer = LlamaTokenizer.from_pretrained(path / "tokenizer",
                                               extra_special_tokens={"image_token": "<|image_pad|>"})
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
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
    model.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                               min_pixels=8 * 8 * 4, max_pixels=64 * 64)
    processor = PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    processor.save_pretrained(path)
    return TinyQwenVL(path, processor, model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyQwenVL:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen3_vl"))


def cases(images) -> list[tuple[str, list]]:
    g, s = images["gradient"], images["shapes"]
    return [(ONE, [g]), (ONE, [s]), (TWO, [g, s]), (TEXT, [])]


@pytest.fixture(scope="module")
def references(tiny, images) -> dict:
    """transformers' greedy tokens and each step's log-softmax, per case."""
    refs = {}
    for i, (text, imgs) in enumerate(cases(images)):
        inputs = tiny.processor(text=text, images=imgs or None, return_tensors="pt")
        with torch.inference_mode():
            out = tiny.hf_model.generate(**inputs, max_new_tokens=greedy().max_tokens, do_sample=False,
                                         output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        refs[i] = tokens, torch.log_softmax(torch.cat(out.logits).float(), -1)
    return refs


def generate_cases(llm, images, references) -> list:
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                            for text, imgs in cases(images)], greedy(), use_tqdm=False)
    for i, output in enumerate(outputs):
        assert_matches_hf(output, references[i])
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the picture matters
    return outputs


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(
        tiny, images, references):
    llm = make_llm(tiny, device=DEVICE)
    try:
        assert type(runner(llm).model).__name__ == "Qwen3VLForConditionalGeneration"
        assert runner(llm).model.deepstack_layers == 2
        generate_cases(llm, images, references)
        same = llm.generate({"prompt": ONE, "multi_modal_data": {"image": images["gradient"]}}, greedy(),
                            use_tqdm=False)[0]
    finally:
        llm.shutdown()
    first_image = same.prompt_token_ids.index(tiny.hf_model.config.image_token_id)
    assert same.num_cached_tokens >= first_image + TOKENS["gradient"]  # every block holding the image is reused
    assert_matches_hf(same, references[0])


def test_chunked_prefill_smaller_than_an_image_matches_transformers(tiny, images, references):
    """Chunks of 16 tokens: each image's 40 or 48 placeholders, and their deepstack rows, span 3 or 4 steps."""
    llm = make_llm(tiny, max_num_batched_tokens=16, device=DEVICE)
    try:
        generate_cases(llm, images, references)
    finally:
        llm.shutdown()

