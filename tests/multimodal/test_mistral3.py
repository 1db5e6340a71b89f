"""Mistral 3 against transformers on a tiny random checkpoint (Pixtral encoder, patch-merger projector, Mistral decoder)
and drawn pictures: each image at its own size expanded row by row (`[IMG]` runs ended by `[IMG_BREAK]` / `[IMG_END]`,
one item with an `is_embed` mask), greedy tokens equal and log-probabilities within 1e-4 (float32), one and two images
per prompt, plain and chunked (10-token steps, fewer than an image's 12 placeholders) with too few KV blocks for the
prompts (preempted, recomputed); prefix caching by picture; tensor parallelism (2 ranks); two images encoded in one
call (block-diagonal attention) equal transformers' image features."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import shapes

MAX_TOKENS = 6
IMAGE_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
ONE = "User: [IMG] What is in the picture?\nAssistant:"
TWO = "User: [IMG] and [IMG] Which one is brighter?\nAssistant:"


@dataclass
class TinyMistral3:
    path: Path
    processor: object
    hf_model: torch.nn.Module
    references: dict = field(default_factory=dict)  # (prompt, pictures' bytes) -> hf_reference's


def pixtral_processor_class() -> type:
    """transformers' PixtralProcessor under another name. Its module imports a helper from the torchvision image
    processor's module, so it cannot be imported without torchvision (absent here): the helper is given from the PIL
    image processor's module (the same function) while it is imported. AutoProcessor resolves the name
    `PixtralProcessor` to a placeholder that asks for torchvision, hence the subclass, registered by name."""
    from transformers.models.pixtral import image_processing_pil_pixtral

    helper = types.ModuleType("transformers.models.pixtral.image_processing_pixtral")
    helper.get_resize_output_image_size = image_processing_pil_pixtral.get_resize_output_image_size
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, helper.__name__, helper)
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    class PixtralPilProcessor(PixtralProcessor):
        pass

    return PixtralPilProcessor


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyMistral3:
    """A Pixtral encoder (patch 8, SwiGLU), spatial merge 2, a 2-layer Mistral, and a PixtralProcessor resizing the
    longest edge to 64 (each image a whole number of 16-pixel merged patches, at its own aspect ratio)."""
    from transformers import AutoProcessor, Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig
    from transformers import PixtralVisionConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    path = tmp_path_factory.mktemp("tiny_mistral3")
    tokenizer = train_llama_tokenizer(path / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=64, patch_size=8, hidden_act="silu",
                                 rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    text = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False, initializer_range=0.3)
    config = Mistral3Config(vision_config=vision.to_dict(), text_config=text.to_dict(), spatial_merge_size=2,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers' init leaves the tiny projector's rows small: make the pictures matter
        for linear in (model.model.multi_modal_projector.linear_1, model.model.multi_modal_projector.linear_2):
            linear.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    processor_class = pixtral_processor_class()
    AutoProcessor.register(Mistral3Config, processor_class, exist_ok=True)
    image_processor = PixtralImageProcessorPil(size={"longest_edge": 64}, patch_size=8)
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                spatial_merge_size=2)
    processor.save_pretrained(path)
    yield TinyMistral3(path, processor, model)
    PROCESSOR_MAPPING._extra_content.pop(Mistral3Config, None)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def hf_reference(tiny: TinyMistral3, text: str, images: list) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens from the same processor output, and its log-softmax rows over prompt + tokens
    (computed once per prompt and pictures)."""
    key = (text, tuple(image.tobytes() for image in images))
    if key not in tiny.references:
        tiny.references[key] = _hf_reference(tiny, text, images)
    return tiny.references[key]


def _hf_reference(tiny: TinyMistral3, text: str, images: list) -> tuple[list[int], torch.Tensor]:
    """transformers' generate and forward on the processor's output."""
    inputs = tiny.processor(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        full = tiny.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
        logits = tiny.hf_model(input_ids=full[None, :-1], pixel_values=inputs["pixel_values"],
                               image_sizes=inputs["image_sizes"]).logits[0]
    return full[inputs["input_ids"].shape[1]:].tolist(), torch.log_softmax(logits.float(), -1)


def assert_matches_hf(tiny: TinyMistral3, output, text: str, images: list) -> None:
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


def assert_prefix_cache_follows_the_image(tiny: TinyMistral3, llm, images) -> None:
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
    """Landscape 60x40 -> 4 x 3 merged patches, portrait 48x64 -> 3 x 4; chunked: steps of 10 tokens end inside
    images; 24 blocks hold one prompt, not three."""
    llm = LLM(str(tiny.path), **{"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 128,
                                 "device": {"num_threads": 1}, "limit_mm_per_prompt": {"image": 2}, **engine_kwargs})
    try:
        assert type(runner(llm).model).__name__ == "Mistral3ForConditionalGeneration"  # ours, not the fallback
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in cases(images)],
                               greedy(), use_tqdm=False)
        if engine_kwargs:
            assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
        if not engine_kwargs:
            ids, features = llm.llm_engine.processor.mm_processor.process(TWO, None, cases(images)[2][1])
            image_token = tiny.hf_model.config.image_token_id
            assert [f.num_embeds for f in features] == [12, 12]
            for feature in features:  # each span runs over its rows' [IMG] runs, the [IMG_BREAK]s between masked out
                assert feature.is_embed.tolist() == [t == image_token for t in ids[feature.offset:feature.end]]
            # two images in one call: block-diagonal attention over both, each image's rows as transformers'
            inputs = tiny.processor(text=TWO, images=cases(images)[2][1], return_tensors="pt")
            with torch.inference_mode():
                ours = runner(llm).model.embed_multimodal(inputs["pixel_values"], inputs["image_sizes"])
                theirs = tiny.hf_model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                                image_sizes=inputs["image_sizes"]).pooler_output
            for mine, reference in zip(ours, theirs, strict=True):
                torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)
        if not engine_kwargs:
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
