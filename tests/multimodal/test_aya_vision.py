"""Aya Vision against transformers on a tiny random checkpoint (SigLIP ViT, gated shuffled projector, Cohere 2 decoder)
and drawn pictures: greedy tokens equal and log-probabilities within 1e-4 (float32), one and two images per prompt,
each image split into tiles plus a global view (runs of placeholders with tile tags between them: one item with an
`is_embed` mask), plain and chunked (10-token steps, fewer than a 3-tile image's 12 placeholders) with too few KV blocks
for the prompts (preempted, recomputed); prefix caching by picture."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import shapes

MAX_TOKENS = 6
TOKENS_PER_TILE = 4  # (32 / 8) ** 2 patches, pixel-shuffled by 2
SPECIAL_TOKENS = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>", "TILE",
                  "TILE_GLOBAL"]
ONE = "User: <image> What is in the picture?\nAssistant:"
TWO = "User: <image> and <image> Which one is brighter?\nAssistant:"


@dataclass
class TinyAya:
    path: Path
    processor: object
    hf_model: torch.nn.Module
    references: dict = field(default_factory=dict)  # (prompt, pictures' bytes) -> hf_reference's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyAya:
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
    return TinyAya(path, processor, model)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def hf_reference(tiny: TinyAya, text: str, images: list) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens from the same processor output, and its log-softmax rows over prompt + tokens
    (computed once per prompt and pictures)."""
    key = (text, tuple(image.tobytes() for image in images))
    if key not in tiny.references:
        tiny.references[key] = _hf_reference(tiny, text, images)
    return tiny.references[key]


def _hf_reference(tiny: TinyAya, text: str, images: list) -> tuple[list[int], torch.Tensor]:
    """transformers' generate and forward on the processor's output."""
    inputs = tiny.processor(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        full = tiny.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
        logits = tiny.hf_model(input_ids=full[None, :-1], pixel_values=inputs["pixel_values"]).logits[0]
    return full[inputs["input_ids"].shape[1]:].tolist(), torch.log_softmax(logits.float(), -1)


def assert_matches_hf(tiny: TinyAya, output, text: str, images: list) -> None:
    tokens, log_probs = hf_reference(tiny, text, images)
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    prompt_len = len(output.prompt_token_ids)
    assert log_probs.shape[0] == prompt_len + MAX_TOKENS - 1  # the engine's prompt holds the processor's expansion
    for t, position in enumerate(completion.logprobs):
        for token, logprob in position.items():
            assert logprob.logprob == pytest.approx(float(log_probs[prompt_len - 1 + t, token]), abs=1e-4)


def cases(images):
    g, s = images["gradient"], images["shapes"]
    return [(ONE, [g]), (ONE, [s]), (TWO, [s, g])]


def runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def assert_each_image_is_one_item_of_its_tiles(tiny: TinyAya, llm, images) -> None:
    """An item holds its own tiles (the global view last) and spans its placeholder runs, the tile tags masked out."""
    _, imgs = cases(images)[2]
    ids, features = llm.llm_engine.processor.mm_processor.process(TWO, None, imgs)
    tiles = [f.data["pixel_values"].shape[0] for f in features]
    assert max(tiles) > 2 and [f.num_embeds for f in features] == [n * TOKENS_PER_TILE for n in tiles]
    for feature in features:
        assert feature.is_embed.tolist() == [t == tiny.hf_model.config.image_token_id
                                             for t in ids[feature.offset:feature.end]]


def assert_prefix_cache_follows_the_image(tiny: TinyAya, llm, images) -> None:
    """The same prompt and picture again reuses every block holding the image; another picture only the text's."""
    g, wide = images["gradient"], shapes(96, 30)
    same = llm.generate({"prompt": ONE, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)[0]
    other = llm.generate({"prompt": ONE, "multi_modal_data": {"image": wide}}, greedy(), use_tqdm=False)[0]
    ids, image_token = same.prompt_token_ids, tiny.hf_model.config.image_token_id
    first_image, last_image = ids.index(image_token), len(ids) - ids[::-1].index(image_token)
    assert same.num_cached_tokens >= last_image - 3  # block size 4
    assert other.num_cached_tokens <= first_image  # its blocks name the other picture
    assert_matches_hf(tiny, same, ONE, [g])
    assert_matches_hf(tiny, other, ONE, [wide])


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 10, "num_gpu_blocks_override": 24},  # too few blocks for three: preempted, recomputed
], ids=["plain", "chunked_and_preempted"])
def test_greedy_tokens_and_logprobs_match_transformers(tiny, images, engine_kwargs):
    """Chunked: steps of 10 tokens end inside images and between their tiles; 24 blocks hold one prompt, not three."""
    llm = LLM(str(tiny.path), **{"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 128,
                                 "device": {"num_threads": 1}, "limit_mm_per_prompt": {"image": 2}, **engine_kwargs})
    try:
        assert type(runner(llm).model).__name__ == "AyaVisionForConditionalGeneration"  # ours, not the fallback
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in cases(images)],
                               greedy(), use_tqdm=False)
        if engine_kwargs:
            assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        if not engine_kwargs:
            assert_each_image_is_one_item_of_its_tiles(tiny, llm, images)
            assert_prefix_cache_follows_the_image(tiny, llm, images)
    finally:
        llm.shutdown()
    for (text, imgs), output in zip(cases(images), outputs, strict=True):
        assert_matches_hf(tiny, output, text, imgs)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the picture matters

