"""Mistral 3 against transformers on a tiny random checkpoint (Pixtral encoder, patch-merger projector, Mistral decoder)
and drawn pictures: each image at its own size expanded row by row (`[IMG]` runs ended by `[IMG_BREAK]` / `[IMG_END]`,
one item with an `is_embed` mask), greedy tokens equal and log-probabilities within 1e-4 (float32), one and two images
per prompt, plain and chunked (10-token steps, fewer than an image's 12 placeholders) with too few KV blocks for the
prompts (preempted, recomputed); prefix caching by picture; tensor parallelism (2 ranks); two images encoded in one
call (block-diagonal attention) equal transformers' image features."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import TinyVLM, model_runner, shapes

MAX_TOKENS = 6
IMAGE_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
ONE = "User: [IMG] What is in the picture?\nAssistant:"
TWO = "User: [IMG] and [IMG] Which one is brighter?\nAssistant:"


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
def tiny(tmp_path_factory) -> TinyVLM:
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
    yield TinyVLM(path, processor, model)
    PROCESSOR_MAPPING._extra_content.pop(Mistral3Config, None)


@pytest.fixture(scope="module")
def case(tiny, images) -> MultimodalParityCase:
    """Landscape 60x40 -> 4 x 3 merged patches, portrait 48x64 -> 3 x 4; steps of 10 tokens end inside images (12
    placeholders each); 24 KV blocks hold one prompt, not three."""
    g, s = images["gradient"], images["shapes"]
    prompts = (MultimodalPrompt(ONE, (g,)), MultimodalPrompt(ONE, (s,)), MultimodalPrompt(TWO, (s, g)))
    return MultimodalParityCase("Mistral3ForConditionalGeneration", tiny.path, tiny.processor, tiny.hf_model, prompts,
                                chunk_budget=10, preemption_blocks=24, max_tokens=MAX_TOKENS)


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(mm_parity, case, images):
    """Plain; each image one item over its rows' [IMG] runs; two images encoded in one call (block-diagonal
    attention) equal transformers' image features; prefix caching by picture (another of another size misses)."""
    with mm_parity.engine(case) as llm:
        assert type(model_runner(llm).model).__name__ == case.name  # ours, not the fallback
        mm_parity.check(case, "plain", llm)
        two = list(case.prompts[2].images)
        ids, features = llm.llm_engine.processor.mm_processor.process(TWO, None, two)
        image_token = case.image_token_id()
        assert [f.num_embeds for f in features] == [12, 12]
        for feature in features:  # each span runs over its rows' [IMG] runs, the [IMG_BREAK]s between masked out
            assert feature.is_embed.tolist() == [t == image_token for t in ids[feature.offset:feature.end]]
        inputs = case.processor(text=TWO, images=two, return_tensors="pt")
        with torch.inference_mode():
            ours = model_runner(llm).model.embed_multimodal(inputs["pixel_values"], inputs["image_sizes"])
            theirs = case.hf_model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                            image_sizes=inputs["image_sizes"]).pooler_output
        for mine, reference in zip(ours, theirs, strict=True):
            torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)
        mm_parity.check_prefix_cache(case, llm, other_image=shapes(96, 30))


@pytest.mark.parametrize("variant", ["preemption", "tp2"])
def test_chunked_preempted_and_tensor_parallel_match_transformers(mm_parity, case, variant):
    """preemption: steps of 10 tokens and too few blocks, requests preempted and recomputed; tp2: each rank runs its
    half of the vision heads and MLP on the same pictures, in steps of 10."""
    mm_parity.check(case, variant)
