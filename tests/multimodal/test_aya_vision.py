"""Aya Vision against transformers on a tiny random checkpoint (SigLIP ViT, gated shuffled projector, Cohere 2 decoder)
and drawn pictures: greedy tokens equal and log-probabilities within 1e-4 (float32), one and two images per prompt,
each image split into tiles plus a global view (runs of placeholders with tile tags between them: one item with an
`is_embed` mask), plain and chunked (10-token steps, fewer than a 3-tile image's 12 placeholders) with too few KV blocks
for the prompts (preempted, recomputed); prefix caching by picture; tensor parallelism (2 ranks)."""

from __future__ import annotations

import pytest
import torch

from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import TinyVLM, model_runner, shapes

MAX_TOKENS = 6
TOKENS_PER_TILE = 4  # (32 / 8) ** 2 patches, pixel-shuffled by 2
SPECIAL_TOKENS = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE",
                  "TILE_GLOBAL"]
ONE = "User: <image> What is in the picture?\nAssistant:"
TWO = "User: <image> and <image> Which one is brighter?\nAssistant:"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyVLM:
    """A SigLIP ViT on 32x32 tiles (patch 8), downsample factor 2, a 2-layer Cohere 2 (one windowed layer with rotary,
    one global without), and an AyaVisionProcessor whose image processor splits an image into up to 2 tiles of 32x32
    plus the global view."""
    from transformers import AyaVisionConfig, AyaVisionForConditionalGeneration, Cohere2Config, SiglipVisionConfig
    from transformers.models.aya_vision.processing_aya_vision import AyaVisionProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    path = tmp_path_factory.mktemp("tiny_aya_vision")
    tokenizer = train_llama_tokenizer(path / "tokenizer")
    tokenizer.add_special_tokens({"pad_token": "<pad>", "additional_special_tokens": SPECIAL_TOKENS})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8)
    text = Cohere2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2,
                         pad_token_id=tokenizer.pad_token_id, logit_scale=1.0, initializer_range=0.3)
    config = AyaVisionConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), downsample_factor=2,
                             image_token_index=tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"),
                             alignment_intermediate_size=96)
    torch.manual_seed(0)
    model = AyaVisionForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers' init leaves the tiny projector's rows small: make the pictures matter
        for linear in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            linear.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    image_processor = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, max_patches=2)
    processor = AyaVisionProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8, img_size=32,
                                   downsample_factor=2)
    processor.save_pretrained(path)
    return TinyVLM(path, processor, model)


@pytest.fixture(scope="module")
def case(tiny, images) -> MultimodalParityCase:
    """Steps of 10 tokens end inside images and between their tiles (a 3-tile image has 12 placeholders); 24 KV
    blocks hold one prompt, not three."""
    g, s = images["gradient"], images["shapes"]
    prompts = (MultimodalPrompt(ONE, (g,)), MultimodalPrompt(ONE, (s,)), MultimodalPrompt(TWO, (s, g)))
    return MultimodalParityCase("AyaVisionForConditionalGeneration", tiny.path, tiny.processor, tiny.hf_model,
                                prompts, chunk_budget=10, preemption_blocks=24, max_tokens=MAX_TOKENS)


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(mm_parity, case):
    """Plain; an item holds its own tiles (the global view last) and spans its placeholder runs, the tile tags masked
    out; prefix caching by picture (another of another size misses)."""
    with mm_parity.engine(case) as llm:
        assert type(model_runner(llm).model).__name__ == case.name  # ours, not the fallback
        mm_parity.check(case, "plain", llm)
        ids, features = llm.llm_engine.processor.mm_processor.process(TWO, None, list(case.prompts[2].images))
        tiles = [f.data["pixel_values"].shape[0] for f in features]
        assert max(tiles) > 2 and [f.num_embeds for f in features] == [n * TOKENS_PER_TILE for n in tiles]
        for feature in features:
            assert feature.is_embed.tolist() == [t == case.image_token_id() for t in ids[feature.offset:feature.end]]
        mm_parity.check_prefix_cache(case, llm, other_image=shapes(96, 30))


@pytest.mark.parametrize("variant", ["preemption", "tp2"])
def test_chunked_preempted_and_tensor_parallel_match_transformers(mm_parity, case, variant):
    """preemption: steps of 10 tokens and too few blocks, requests preempted and recomputed; tp2: each rank runs its
    half of the vision heads and of the decoder (a windowed and a global layer) on the same pictures, in steps of
    10."""
    mm_parity.check(case, variant)
