"""InternVL against transformers on a tiny random checkpoint (InternViT with layer scale, shuffled MLP projector, Qwen2
decoder) and drawn pictures: greedy tokens equal and log-probabilities within 1e-4 (float32), one and two images per
prompt, each image split into tiles plus a thumbnail (one run of placeholders), plain and chunked (10-token steps, fewer
than a 3-tile image's 12 placeholders) with too few KV blocks for the prompts (preempted, recomputed); prefix caching
by picture; tensor parallelism (2 ranks)."""

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
IMAGE_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                "video_token": "<video>"}
ONE = "User: <IMG_CONTEXT> What is in the picture?\nAssistant:"
TWO = "User: <IMG_CONTEXT> and <IMG_CONTEXT> Which one is brighter?\nAssistant:"


@dataclass
class TinyInternVL:
    path: Path
    processor: object
    hf_model: torch.nn.Module
    references: dict = field(default_factory=dict)  # (prompt, pictures' bytes) -> hf_reference's


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
def tiny(tmp_path_factory) -> TinyInternVL:
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
    yield TinyInternVL(path, processor, model)
    PROCESSOR_MAPPING._extra_content.pop(InternVLConfig, None)


def _tokenizer(path: Path):
    """The tiny tokenizer with InternVL's image tokens, named as InternVLProcessor reads them."""
    tokenizer = train_llama_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS.values())})
    tokenizer.save_pretrained(path)
    return type(tokenizer).from_pretrained(path, extra_special_tokens=IMAGE_TOKENS)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def hf_reference(tiny: TinyInternVL, text: str, images: list) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens from the same processor output, and its log-softmax rows over prompt + tokens
    (computed once per prompt and pictures)."""
    key = (text, tuple(image.tobytes() for image in images))
    if key not in tiny.references:
        tiny.references[key] = _hf_reference(tiny, text, images)
    return tiny.references[key]


def _hf_reference(tiny: TinyInternVL, text: str, images: list) -> tuple[list[int], torch.Tensor]:
    """transformers' generate and forward on the processor's output."""
    inputs = tiny.processor(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        full = tiny.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
        logits = tiny.hf_model(input_ids=full[None, :-1], pixel_values=inputs["pixel_values"]).logits[0]
    return full[inputs["input_ids"].shape[1]:].tolist(), torch.log_softmax(logits.float(), -1)


def assert_matches_hf(tiny: TinyInternVL, output, text: str, images: list) -> None:
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


def assert_prefix_cache_follows_the_image(tiny: TinyInternVL, llm, images) -> None:
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
        assert type(runner(llm).model).__name__ == "InternVLForConditionalGeneration"  # ours, not the fallback
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in cases(images)],
                               greedy(), use_tqdm=False)
        if engine_kwargs:
            assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        if not engine_kwargs:
            _, features = llm.llm_engine.processor.mm_processor.process(TWO, None, cases(images)[2][1])
            tiles = [f.data["pixel_values"].shape[0] for f in features]  # each item its own tiles
            assert max(tiles) > 2 and [f.num_embeds for f in features] == [n * TOKENS_PER_TILE for n in tiles]
            assert_prefix_cache_follows_the_image(tiny, llm, images)
    finally:
        llm.shutdown()
    for (text, imgs), output in zip(cases(images), outputs, strict=True):
        assert_matches_hf(tiny, output, text, imgs)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the picture matters


def test_tensor_parallel_encodes_on_every_rank(tiny, images):
    """TP=2: each rank runs its half of the vision heads and MLP on the same pictures; chunks of 5 tokens."""
    llm = LLM(str(tiny.path), dtype="float32", block_size=4, num_gpu_blocks_override=128, device={"num_threads": 1},
              limit_mm_per_prompt={"image": 2}, tensor_parallel_size=2, max_num_batched_tokens=5)
    try:
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in cases(images)],
                               greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    for (text, imgs), output in zip(cases(images), outputs, strict=True):
        assert_matches_hf(tiny, output, text, imgs)
