"""Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints and drawn pictures of two sizes and
aspect ratios: M-RoPE positions equal transformers' `get_rope_index`; greedy tokens equal and log-probabilities
within 1e-4 (float32) over a decode long enough that every generated token's position depends on the prompt's
delta, plain, under chunked prefill whose budget is smaller than one image, and with preemption; a prefix-cache hit
for the same image and a miss for another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import TinyVLM, copy_with_renamed_weights, model_runner

MAX_TOKENS = 8
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"User: {IMAGE}What is in the picture?\nAssistant:"
TWO = f"User: {IMAGE} and {IMAGE}Which one is brighter?\nAssistant:"
TEXT = "User: What is a picture?\nAssistant:"
SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# 60x40 -> 64x40 pixels: 16x10 patches of 4, a 8x5 grid of 2x2 merge blocks (40 tokens); 48x64 -> 12x16, 6x8 (48)
TOKENS = {"gradient": 40, "shapes": 48}


def qwen_tokenizer(path: Path) -> tuple[object, dict[str, int]]:
    """The tiny tokenizer with Qwen's vision tokens, and their ids; the processor reads its placeholder from the
    tokenizer's named `image_token`."""
    from transformers import LlamaTokenizer

    train_llama_tokenizer(path).save_pretrained(path)
    tokenizer = LlamaTokenizer.from_pretrained(path, extra_special_tokens={"image_token": "<|image_pad|>"})
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    return tokenizer, {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def save_with_processor(path: Path, model, tokenizer) -> TinyVLM:
    """Save `model` with its processor: 4-pixel patches merged 2x2, 8 x 8 to 64 x 64 pixels."""
    from transformers import PaddleOCRVLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                               min_pixels=8 * 8 * 4, max_pixels=64 * 64)
    processor = PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    processor.save_pretrained(path)
    return TinyVLM(path, processor, model)


def save_tiny(path: Path, family: str) -> TinyVLM:
    """A 2- or 3-layer vision tower on 4-pixel patches merged 2x2 (Qwen2.5-VL: windows of 2x2 merge blocks, its
    middle layer attending over the whole image; embeddings tied), a 2-layer M-RoPE Qwen2 decoder.

    The processor is transformers' PaddleOCRVLProcessor over Qwen2VLImageProcessorPil: Qwen2VLProcessor and
    Qwen2_5_VLProcessor insist on a video processor, which needs torchvision (absent here); PaddleOCR-VL's
    processor expands each `<|image_pad|>` into image_grid_thw.prod() / merge**2 placeholders exactly as
    Qwen2VLProcessor.replace_image_token does, and returns the same tensors (mm_token_type_ids included)."""
    import transformers

    tokenizer, ids = qwen_tokenizer(path / "tokenizer")
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                eos_token_id=None, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                    "rope_theta": 10000.0})
    common = dict(num_heads=4, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, **common)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        tied = False
    else:
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=16,
                      fullatt_block_indexes=[1], **common)
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        tied = True
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # transformers' init leaves the tiny merger's rows small: make the pictures matter
        model.model.visual.merger.mlp[2].weight.normal_(0, 0.5)
        for name, param in model.model.language_model.layers.named_parameters():
            if name.endswith("proj.weight"):  # and the layers' outputs, beside a tied head's echo of the last token
                param.normal_(0, 0.2)
    return save_with_processor(path, model, tokenizer)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def tiny(request, tmp_path_factory) -> TinyVLM:
    return save_tiny(tmp_path_factory.mktemp(f"tiny_{request.param}"), request.param)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def case(tiny, images) -> MultimodalParityCase:
    """One and two pictures a prompt and a text prompt; chunks of 16 tokens (each image's 40 or 48 placeholders span 3
    or 4 steps), and 40 KV blocks for every request."""
    g, s = images["gradient"], images["shapes"]
    prompts = (MultimodalPrompt(ONE, (g,)), MultimodalPrompt(ONE, (s,)), MultimodalPrompt(TWO, (g, s)),
               MultimodalPrompt(TWO, (s, g)), MultimodalPrompt(TEXT))
    return MultimodalParityCase(tiny.hf_model.config.architectures[0], tiny.path, tiny.processor, tiny.hf_model,
                                prompts, chunk_budget=16, preemption_blocks=40, max_tokens=MAX_TOKENS,
                                engine_kwargs={"max_num_seqs": 4})


def test_mrope_positions_equal_transformers_rope_index(tiny, images, llm):
    """Each prompt's [3, P] positions and delta, from the engine's features, as transformers computes them."""
    model = model_runner(llm).model
    g, s = images["gradient"], images["shapes"]
    for text, imgs in [(ONE, [g]), (ONE, [s]), (TWO, [g, s]), (TWO, [s, g])]:
        ids, features = llm.llm_engine.processor.mm_processor.process(text, None, imgs)
        assert [f.length for f in features] == [TOKENS["gradient" if im is g else "shapes"] for im in imgs]
        positions, delta = model.get_mrope_input_positions(ids, features)
        inputs = tiny.processor(text=text, images=imgs, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == ids
        expected, deltas = tiny.hf_model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"])
        assert positions.tolist() == expected[:, 0].tolist()
        assert delta == int(deltas[0, 0]) < -30  # each image's tokens span fewer positions than tokens


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(
        mm_parity, case, images, llm):
    """Every case at once, over a decode long enough that every generated token's position depends on the prompt's
    delta; then the same image again (a prefix-cache hit: the cached blocks' keys were rotated by the image's
    positions), another (a miss), and a token-id prompt."""
    assert type(model_runner(llm).model).__name__ == case.name  # ours, not a fallback
    mm_parity.check(case, "plain", llm)
    mm_parity.check_prefix_cache(case, llm)
    # a token-id prompt with one placeholder per image: each expanded by its own image's count (40 and 48)
    g, s = images["gradient"], images["shapes"]
    ids = case.processor.tokenizer.encode(TWO)
    (from_ids,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [g, s]}}, greedy(),
                               use_tqdm=False)
    mm_parity.assert_matches(case, from_ids, MultimodalPrompt(TWO, (g, s)))


def test_chunked_prefill_smaller_than_an_image_with_preemption_matches_transformers(mm_parity, case):
    """Chunks of 16 tokens and too few blocks for every request: preempted ones recompute their prompt and generated
    tokens, positions and all."""
    mm_parity.check(case, "preemption")


@pytest.mark.parametrize("tiny", ["qwen2_5_vl"], indirect=True)  # its tower shards every layer kind Qwen2-VL's does
def test_tensor_parallel_encodes_on_every_rank(mm_parity, case):
    """TP=2: each rank runs its half of the tower's heads and MLP and of the merger's features on the same patches,
    chunked inside the images."""
    mm_parity.check(case, "tp2")


@pytest.mark.parametrize("tiny", ["qwen2_vl"], indirect=True)  # the layout is the same for both rows
def test_transformers_5_checkpoint_layout_loads_alike(mm_parity, case, tmp_path):
    """The tensors renamed as transformers 5 holds them in memory (`model.language_model.*`, `model.visual.*`)."""
    copy_with_renamed_weights(case.model, tmp_path, {"model.": "model.language_model.", "visual.": "model.visual.",
                                                     "lm_head.": "lm_head."})
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_gpu_blocks_override=256, device={"num_threads": 1},
              limit_mm_per_prompt={"image": 2})
    prompt = case.prompts[2]
    (output,) = mm_parity.generate(case, llm, [prompt])
    mm_parity.assert_matches(case, output, prompt)
    llm.shutdown()
