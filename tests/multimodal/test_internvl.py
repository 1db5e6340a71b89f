"""InternVL against transformers on a tiny random checkpoint (InternViT with layer scale, shuffled MLP projector, Qwen2
decoder) and drawn pictures: greedy tokens equal and log-probabilities within 1e-4 (float32), one and two images per
prompt, each image split into tiles plus a thumbnail (one run of placeholders), plain and chunked (10-token steps, fewer
than a 3-tile image's 12 placeholders) with too few KV blocks for the prompts (preempted, recomputed); prefix caching
by picture; tensor parallelism (2 ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import TinyVLM, model_runner, shapes

MAX_TOKENS = 6
TOKENS_PER_TILE = 4  # (32 / 8) ** 2 patches, pixel-shuffled by 2
IMAGE_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                "video_token": "<video>"}
ONE = "User: <IMG_CONTEXT> What is in the picture?\nAssistant:"
TWO = "User: <IMG_CONTEXT> and <IMG_CONTEXT> Which one is brighter?\nAssistant:"


def image_only_processor_class() -> type:
    """InternVLProcessor without its video processor, whose class needs torchvision (absent here; transformers refuses
    to build the processor without it): the image path, placeholder expansion and token counts are InternVLProcessor's
    own, inherited."""
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    class InternVLImageProcessor(InternVLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, image_seq_length: int = 256, chat_template=None,
                     **kwargs) -> None:
            super().__init__(image_processor, tokenizer, None, image_seq_length, chat_template, **kwargs)

    return InternVLImageProcessor


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyVLM:
    """InternViT on 32x32 tiles (patch 8; its class token, position table and layer-scale vectors drawn at random, which
    transformers' init leaves constant), downsample ratio 0.5, a 2-layer Qwen2, and the processor above splitting an
    image into up to 2 tiles of 32x32 plus a thumbnail. The processor class is registered with AutoProcessor for the
    module, so the engine loads it from the folder."""
    from transformers import AutoProcessor, InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig
    from transformers import Qwen2Config
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    path = tmp_path_factory.mktemp("tiny_internvl")
    tokenizer = _tokenizer(path / "tokenizer")
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=[32, 32], patch_size=[8, 8], attention_bias=True)
    text = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                       eos_token_id=2, tie_word_embeddings=False, initializer_range=0.3)
    config = InternVLConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), downsample_ratio=0.5,
                            image_token_id=tokenizer.context_image_token_id, image_seq_length=TOKENS_PER_TILE,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.model.vision_tower.named_parameters():
            if name.split(".")[-1] in ("cls_token", "position_embeddings", "lambda_1", "lambda_2"):
                param.normal_(0, 0.5)
        for linear in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            linear.weight.normal_(0, 0.5)  # transformers' init leaves the tiny projector's rows small
    model.save_pretrained(path)
    processor_class = image_only_processor_class()
    AutoProcessor.register(InternVLConfig, processor_class, exist_ok=True)
    image_processor = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, max_patches=2)
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer,
                                image_seq_length=TOKENS_PER_TILE)
    processor.save_pretrained(path)
    yield TinyVLM(path, processor, model)
    PROCESSOR_MAPPING._extra_content.pop(InternVLConfig, None)


def _tokenizer(path: Path):
    """The tiny tokenizer with InternVL's image tokens, named as InternVLProcessor reads them."""
    tokenizer = train_llama_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS.values())})
    tokenizer.save_pretrained(path)
    return type(tokenizer).from_pretrained(path, extra_special_tokens=IMAGE_TOKENS)


@pytest.fixture(scope="module")
def case(tiny, images) -> MultimodalParityCase:
    """Steps of 10 tokens end inside images and between their tiles (a 3-tile image has 12 placeholders); 24 KV
    blocks hold one prompt, not three."""
    g, s = images["gradient"], images["shapes"]
    prompts = (MultimodalPrompt(ONE, (g,)), MultimodalPrompt(ONE, (s,)), MultimodalPrompt(TWO, (s, g)))
    return MultimodalParityCase("InternVLForConditionalGeneration", tiny.path, tiny.processor, tiny.hf_model, prompts,
                                chunk_budget=10, preemption_blocks=24, max_tokens=MAX_TOKENS)


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(mm_parity, case):
    """Plain; each image one item of its own tiles; prefix caching by picture (another of another size misses)."""
    with mm_parity.engine(case) as llm:
        assert type(model_runner(llm).model).__name__ == case.name  # ours, not the fallback
        mm_parity.check(case, "plain", llm)
        _, features = llm.llm_engine.processor.mm_processor.process(TWO, None, list(case.prompts[2].images))
        tiles = [f.data["pixel_values"].shape[0] for f in features]  # each item its own tiles
        assert max(tiles) > 2 and [f.num_embeds for f in features] == [n * TOKENS_PER_TILE for n in tiles]
        mm_parity.check_prefix_cache(case, llm, other_image=shapes(96, 30))


@pytest.mark.parametrize("variant", ["preemption", "tp2"])
def test_chunked_preempted_and_tensor_parallel_match_transformers(mm_parity, case, variant):
    """preemption: steps of 10 tokens and too few blocks, requests preempted and recomputed; tp2: each rank runs its
    half of the vision heads and MLP on the same pictures, in steps of 10."""
    mm_parity.check(case, variant)
