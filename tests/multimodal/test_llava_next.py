"""LLaVA-NeXT (anyres) against transformers on a tiny random checkpoint and drawn pictures of four aspect ratios
(so three grids and both unpadding directions): the anyres tiling and packing equal transformers'; greedy tokens
equal and log-probabilities within 1e-4 (float32) with one and two images per prompt, plain, under chunked prefill
whose budget is smaller than one image, and with preemption; a prefix-cache hit for the same image."""

from __future__ import annotations

import itertools

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.layers.vision import AnyResGrid
from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.multimodal.conftest import (
    CHAT_TEMPLATE,
    IMAGE_TOKEN,
    TinyVLM,
    copy_with_renamed_weights,
    gradient,
    model_runner,
    shapes,
)

MAX_TOKENS = 8
PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # (height, width): llava-v1.6's grids scaled to a 32-pixel tower
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image> and <image>\nWhich one is brighter? ASSISTANT:"


def tiny_config(image_token_index: int, vocab_size: int, **overrides):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                       eos_token_id=None)
    return LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=image_token_index,
                           image_grid_pinpoints=PINPOINTS, **overrides)


@pytest.fixture(scope="module")
def tiny_llava_next(tmp_path_factory) -> TinyVLM:
    """A tiny random LLaVA-NeXT (CLIP 32x32 tiles, patch 8: 16 rows a tile; a 2-layer Llama) saved with its
    LlavaNextProcessor and PIL LlavaNextImageProcessor."""
    from transformers import LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from tests.models.tiny_models import train_llama_tokenizer

    path = tmp_path_factory.mktemp("tiny_llava_next")
    tokenizer = train_llama_tokenizer(path / "tokenizer")
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    config = tiny_config(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), len(tokenizer))
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()  # transformers' init, image_newline included
    model.save_pretrained(path)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                 image_grid_pinpoints=PINPOINTS)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return TinyVLM(path, processor, model)


@pytest.fixture(scope="module")
def pictures() -> dict:
    """(width, height): landscape 60x40 and portrait 48x64 take the 2x2 grid (unpadded in rows, then in columns),
    wide 90x30 the 1x2 grid, tall 30x80 the 2x1 grid."""
    return {"landscape": gradient(60, 40), "portrait": shapes(48, 64), "wide": gradient(90, 30),
            "tall": shapes(30, 80)}


def greedy(logprobs: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


@pytest.fixture(scope="module")
def case(tiny_llava_next, pictures) -> MultimodalParityCase:
    """One image of each grid, and two images of different tile counts (the processor pads the fewer tiles); chunks
    of 16 tokens (an image's 34-72 placeholders span several steps), and 60 KV blocks for four prompts."""
    p = pictures
    prompts = (MultimodalPrompt(ONE, (p["landscape"],)), MultimodalPrompt(ONE, (p["wide"],)),
               MultimodalPrompt(TWO, (p["portrait"], p["wide"])), MultimodalPrompt(TWO, (p["tall"], p["landscape"])))
    return MultimodalParityCase("LlavaNextForConditionalGeneration", tiny_llava_next.path, tiny_llava_next.processor,
                                tiny_llava_next.hf_model, prompts, chunk_budget=16, preemption_blocks=60,
                                max_tokens=MAX_TOKENS, engine_kwargs={"max_num_seqs": 4})


def test_tiles_grid_and_row_count_equal_transformers(tiny_llava_next):
    """AnyResGrid's tiles and grid equal transformers' for many image sizes, and the rows it packs equal the
    placeholders the processor writes (`_get_number_of_features`, less the class token)."""
    from transformers.models.llava_next.modeling_llava_next import (
        get_anyres_image_grid_shape,
        image_size_to_num_patches,
    )

    grid = AnyResGrid(tuple(map(tuple, PINPOINTS)), 32, 4)
    newline = torch.zeros(8)
    for height, width in itertools.product([7, 20, 30, 32, 41, 64, 99, 200], repeat=2):
        size = (height, width)
        assert grid.num_tiles(size) == image_size_to_num_patches(list(size), PINPOINTS, 32)
        assert grid.grid_shape(size) == get_anyres_image_grid_shape(list(size), PINPOINTS, 32)
        features = torch.zeros(grid.num_tiles(size), 16, 8)
        rows = grid.pack(features, size, newline).shape[0]
        assert rows == tiny_llava_next.processor._get_number_of_features(height, width, 32, 32) - 1


@pytest.mark.parametrize("feature_layer", [-2, [-3, -1]], ids=["one_layer", "two_layers"])
def test_packed_image_rows_equal_transformers(tiny_llava_next, pictures, feature_layer):
    """embed_multimodal of each picture alone equals transformers' get_image_features (vision_feature_layer an int
    or a list; the projector then takes the layers' features side by side)."""
    from transformers import LlavaNextForConditionalGeneration

    from llmplug.plugins.models.llava import LlavaNextForConditionalGeneration as Ours

    hf_config = tiny_config(tiny_llava_next.hf_model.config.image_token_index,
                            tiny_llava_next.hf_model.config.text_config.vocab_size, vision_feature_layer=feature_layer)
    torch.manual_seed(1)
    hf = LlavaNextForConditionalGeneration(hf_config).eval()
    ours = Ours(config=hf_config)
    ours.load_weights((name, tensor) for name, tensor in hf.state_dict().items())
    for name, picture in pictures.items():
        inputs = tiny_llava_next.processor(text=IMAGE_TOKEN, images=[picture], return_tensors="pt")
        with torch.inference_mode():
            (rows,) = ours.embed_multimodal(inputs["pixel_values"], inputs["image_sizes"])
            (expected,) = hf.model.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output
        assert rows.shape == expected.shape, name
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(mm_parity, case, llm):
    mm_parity.check(case, "plain", llm)
    mm_parity.check_prefix_cache(case, llm)


@pytest.mark.parametrize("variant", ["preemption", "tp2"])
def test_chunked_inside_an_image_preempted_and_tensor_parallel_match_transformers(mm_parity, case, variant):
    """preemption: chunks of 16 and too few blocks, requests preempted and recomputed; tp2: each rank runs its half
    of the tower's heads and of the projector on every tile of the same image, in chunks of 16."""
    mm_parity.check(case, variant)


def test_images_of_a_prompt_keep_their_own_tiles(llm, pictures):
    """llmplug's own LLaVA-NeXT runs the folder. Two images of 5 and 3 tiles: each feature holds its own
    image_sizes, the placeholder runs are the packed row counts of each (72 and 34), and the processor's batch
    padding of the smaller one (to 5 tiles) is left to the model, which trims it by image_sizes."""
    from llmplug.plugins.models.llava import LlavaNextForConditionalGeneration

    assert type(model_runner(llm).model) is LlavaNextForConditionalGeneration
    processed = llm.llm_engine.processor.process_multimodal(
        {"prompt": TWO, "multi_modal_data": {"image": [pictures["portrait"], pictures["wide"]]}})
    portrait, wide = processed["mm_features"]
    assert [portrait.length, wide.length] == [72, 34]
    assert portrait.data["image_sizes"].tolist() == [[64, 48]] and wide.data["image_sizes"].tolist() == [[30, 90]]
    assert portrait.data["pixel_values"].shape[:2] == wide.data["pixel_values"].shape[:2] == (1, 5)


def test_token_ids_prompt_with_one_placeholder_per_image_expands_each_by_its_own_count(mm_parity, case, llm, pictures):
    """Two images of other sizes expand to 72 and 34 placeholders: a token-id prompt with one per image answers
    as the text prompt does."""
    imgs = (pictures["portrait"], pictures["wide"])
    ids = case.processor.tokenizer.encode(TWO)
    (output,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": list(imgs)}}, greedy(),
                             use_tqdm=False)
    mm_parity.assert_matches(case, output, MultimodalPrompt(TWO, imgs))


def test_transformers_5_weight_names_load_the_same_model(mm_parity, case, pictures, tmp_path):
    """`model.image_newline`, `model.vision_tower.*`, ... (transformers 5's layout) as well as the saved one."""
    renames = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
               "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector.",
               "image_newline": "model.image_newline"}
    assert "model.image_newline" in copy_with_renamed_weights(case.model, tmp_path, renames)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_gpu_blocks_override=64, device={"num_threads": 1})
    output = llm.generate({"prompt": ONE, "multi_modal_data": {"image": pictures["portrait"]}}, greedy(),
                          use_tqdm=False)[0]
    mm_parity.assert_matches(case, output, MultimodalPrompt(ONE, (pictures["portrait"],)))
    llm.shutdown()
