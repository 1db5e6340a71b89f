"""Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints and drawn pictures of two sizes and
aspect ratios: M-RoPE positions equal transformers' `get_rope_index`; greedy tokens equal and log-probabilities
within 1e-4 (float32) over a decode long enough that every generated token's position depends on the prompt's
delta, plain, under chunked prefill whose budget is smaller than one image, and with preemption; a prefix-cache hit
for the same image and a miss for another."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import copy_with_renamed_weights

MAX_TOKENS = 8
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"User: {IMAGE}What is in the picture?\nAssistant:"
TWO = f"User: {IMAGE} and {IMAGE}Which one is brighter?\nAssistant:"
TEXT = "User: What is a picture?\nAssistant:"
SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# 60x40 -> 64x40 pixels: 16x10 patches of 4, a 8x5 grid of 2x2 merge blocks (40 tokens); 48x64 -> 12x16, 6x8 (48)
TOKENS = {"gradient": 40, "shapes": 48}


@dataclass
class TinyQwenVL:
    path: Path
    processor: object
    hf_model: torch.nn.Module


def save_tiny(path: Path, family: str) -> TinyQwenVL:
    """A 2- or 3-layer vision tower on 4-pixel patches merged 2x2 (Qwen2.5-VL: windows of 2x2 merge blocks, its
    middle layer attending over the whole image; embeddings tied), a 2-layer M-RoPE Qwen2 decoder.

    The processor is transformers' PaddleOCRVLProcessor over Qwen2VLImageProcessorPil: Qwen2VLProcessor and
    Qwen2_5_VLProcessor insist on a video processor, which needs torchvision (absent here); PaddleOCR-VL's
    processor expands each `<|image_pad|>` into image_grid_thw.prod() / merge**2 placeholders exactly as
    Qwen2VLProcessor.replace_image_token does, and returns the same tensors (mm_token_type_ids included)."""
    import transformers
    from transformers import LlamaTokenizer, PaddleOCRVLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    train_llama_tokenizer(path / "tokenizer").save_pretrained(path / "tokenizer")
    # the processor reads its placeholder from the tokenizer's named `image_token`
    tokenizer = LlamaTokenizer.from_pretrained(path / "tokenizer",
                                               extra_special_tokens={"image_token": "<|image_pad|>"})
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
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
    model.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                               min_pixels=8 * 8 * 4, max_pixels=64 * 64)
    processor = PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    processor.save_pretrained(path)
    return TinyQwenVL(path, processor, model)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def tiny(request, tmp_path_factory) -> TinyQwenVL:
    return save_tiny(tmp_path_factory.mktemp(f"tiny_{request.param}"), request.param)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def make_llm(tiny: TinyQwenVL, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 256,
              "limit_mm_per_prompt": {"image": 2}, **kwargs}
    return LLM(str(tiny.path), **kwargs)


def runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def cases(images) -> list[tuple[str, list]]:
    g, s = images["gradient"], images["shapes"]
    return [(ONE, [g]), (ONE, [s]), (TWO, [g, s]), (TWO, [s, g]), (TEXT, [])]


@pytest.fixture(scope="module")
def references(tiny, images) -> dict:
    """transformers' greedy tokens and each step's log-softmax [MAX_TOKENS, V], per case (index into `cases`)."""
    refs = {}
    for i, (text, imgs) in enumerate(cases(images)):
        inputs = tiny.processor(text=text, images=imgs or None, return_tensors="pt")
        with torch.inference_mode():
            out = tiny.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                                         return_dict_in_generate=True)
        tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        refs[i] = tokens, torch.log_softmax(torch.cat(out.logits).float(), -1)
    return refs


def assert_matches_hf(output, reference) -> None:
    tokens, log_probs = reference
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    for t, position in enumerate(completion.logprobs):
        for token, logprob in position.items():
            assert logprob.logprob == pytest.approx(float(log_probs[t, token]), abs=1e-4)


@pytest.fixture(scope="module")
def plain_llm(tiny):
    llm = make_llm(tiny)
    yield llm
    llm.shutdown()


def test_mrope_positions_equal_transformers_rope_index(tiny, images, plain_llm):
    """Each prompt's [3, P] positions and delta, from the engine's features, as transformers computes them."""
    model = runner(plain_llm).model
    for text, imgs in cases(images)[:4]:
        ids, features = plain_llm.llm_engine.processor.mm_processor.process(text, None, imgs)
        assert [f.length for f in features] == [TOKENS["gradient" if im is images["gradient"] else "shapes"]
                                                for im in imgs]
        positions, delta = model.get_mrope_input_positions(ids, features)
        inputs = tiny.processor(text=text, images=imgs, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == ids
        expected, deltas = tiny.hf_model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"])
        assert positions.tolist() == expected[:, 0].tolist()
        assert delta == int(deltas[0, 0]) < -30  # each image's tokens span fewer positions than tokens


def generate_cases(llm: LLM, images, references) -> list:
    """Every case at once, each checked against transformers."""
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
                            for text, imgs in cases(images)], greedy(), use_tqdm=False)
    for i, output in enumerate(outputs):
        assert_matches_hf(output, references[i])
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the picture matters
    return outputs


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(
        tiny, images, references, plain_llm):
    """Every case at once; then the same image again (a prefix-cache hit), another (a miss), and a token-id prompt."""
    assert type(runner(plain_llm).model).__name__ == tiny.hf_model.config.architectures[0]  # ours, not a fallback
    generate_cases(plain_llm, images, references)
    g = images["gradient"]
    same = plain_llm.generate({"prompt": ONE, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)[0]
    other = plain_llm.generate({"prompt": ONE, "multi_modal_data": {"image": g.rotate(180)}},
                               SamplingParams(max_tokens=1), use_tqdm=False)[0]
    first_image = same.prompt_token_ids.index(tiny.hf_model.config.image_token_id)
    assert same.num_cached_tokens >= first_image + TOKENS["gradient"]  # every block holding the image is reused
    assert other.num_cached_tokens <= first_image  # only the text before the image: its blocks name the image
    assert_matches_hf(same, references[0])  # the cached blocks' keys were rotated by the image's positions
    # a token-id prompt with one placeholder per image: each expanded by its own image's count (40 and 48)
    g, s = images["gradient"], images["shapes"]
    ids = tiny.processor.tokenizer.encode(TWO)
    (from_ids,) = plain_llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [g, s]}}, greedy(),
                                     use_tqdm=False)
    assert from_ids.prompt_token_ids == tiny.processor(text=TWO, images=[g, s])["input_ids"][0]
    assert_matches_hf(from_ids, references[2])


def test_chunked_prefill_smaller_than_an_image_with_preemption_matches_transformers(tiny, images, references):
    """Chunks of 16 tokens (each image's 40 or 48 placeholders span 3 or 4 steps) and too few blocks for every
    request: preempted ones recompute their prompt and generated tokens, positions and all."""
    llm = make_llm(tiny, max_num_batched_tokens=16, num_gpu_blocks_override=40, max_num_seqs=4)
    generate_cases(llm, images, references)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    llm.shutdown()



@pytest.mark.parametrize("tiny", ["qwen2_5_vl"], indirect=True)  # its tower shards every layer kind Qwen2-VL's does
def test_tensor_parallel_encodes_on_every_rank(tiny, images, references):
    """TP=2: each rank runs its half of the tower's heads and MLP and of the merger's features on the same patches;
    the two-image prompts, chunked inside the images."""
    llm = make_llm(tiny, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        two = [2, 3]
        outputs = llm.generate([{"prompt": cases(images)[i][0], "multi_modal_data": {"image": cases(images)[i][1]}}
                                for i in two], greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    for i, output in zip(two, outputs):
        assert_matches_hf(output, references[i])


@pytest.mark.parametrize("tiny", ["qwen2_vl"], indirect=True)  # the layout is the same for both rows
def test_transformers_5_checkpoint_layout_loads_alike(tiny, images, references, tmp_path):
    """The tensors renamed as transformers 5 holds them in memory (`model.language_model.*`, `model.visual.*`)."""
    copy_with_renamed_weights(tiny.path, tmp_path, {"model.": "model.language_model.", "visual.": "model.visual.",
                                                    "lm_head.": "lm_head."})
    llm = make_llm(TinyQwenVL(tmp_path, tiny.processor, tiny.hf_model))
    text, imgs = cases(images)[2]
    (output,) = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, greedy(), use_tqdm=False)
    assert_matches_hf(output, references[2])
    llm.shutdown()
