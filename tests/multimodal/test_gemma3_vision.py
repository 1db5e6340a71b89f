"""Gemma 3 with images against transformers on a tiny random checkpoint (SigLIP 32x32, patch 4: an 8 x 8 grid pooled
to 16 image tokens; a 2-layer Gemma 3 decoder, one sliding-window layer) and drawn pictures: greedy tokens equal and
log-probabilities within 1e-4 (float32), plain and under chunked prefill inside an image, one and two images.

The reference is transformers without `token_type_ids`, i.e. causal attention over the image tokens, which is what
llmplug computes; transformers' own Gemma 3 lets an image's tokens see one another (a block mask at prefill), which
llmplug does not do yet: `test_bidirectional_image_attention_is_not_there_yet` records the gap."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from tests.models.tiny_models import train_llama_tokenizer

MAX_TOKENS = 6
NUM_IMAGE_TOKENS = 16
SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
ONE = "User: <start_of_image> What is in the picture? Model:"
TWO = "User: <start_of_image> or <start_of_image> Which one is brighter? Model:"


@dataclass
class TinyGemma3:
    path: Path
    processor: object
    hf_model: torch.nn.Module


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> TinyGemma3:
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    path = tmp_path_factory.mktemp("tiny_gemma3")
    base = train_llama_tokenizer(path / "sp")
    base.add_tokens(list(SPECIAL.values()), special_tokens=True)
    base.save_pretrained(path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer", extra_special_tokens=SPECIAL)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=4, vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            max_position_embeddings=256)
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=NUM_IMAGE_TOKENS,
                          image_token_id=tokenizer.image_token_id, boi_token_id=tokenizer.boi_token_id,
                          eoi_token_id=tokenizer.eoi_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the init's (zeros for the projector), so that the image matters; larger
        for param in model.parameters():  # still makes one token win whatever the picture
            param.normal_(0, 0.05)
    model.save_pretrained(path)
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                image_seq_length=NUM_IMAGE_TOKENS)
    processor.save_pretrained(path)
    return TinyGemma3(path, processor, model)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def hf_reference(tiny: TinyGemma3, text: str, images: list, bidirectional: bool) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and log-softmax rows over prompt + tokens; `bidirectional`: with the processor's
    `token_type_ids` (each image's tokens see one another), else causal over every token."""
    inputs = dict(tiny.processor(text=text, images=images, return_tensors="pt"))
    token_type_ids = inputs.pop("token_type_ids")
    extra = {"token_type_ids": token_type_ids} if bidirectional else {}
    with torch.inference_mode():
        full = tiny.hf_model.generate(**inputs, **extra, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
        if bidirectional:
            extra = {"token_type_ids": torch.nn.functional.pad(token_type_ids, (0, MAX_TOKENS - 1))}
        logits = tiny.hf_model(input_ids=full[None, :-1], pixel_values=inputs["pixel_values"], **extra).logits[0]
    return full[inputs["input_ids"].shape[1]:].tolist(), torch.log_softmax(logits.float(), -1)


def assert_matches_hf(tiny: TinyGemma3, output, text: str, images: list, bidirectional: bool = False) -> None:
    tokens, log_probs = hf_reference(tiny, text, images, bidirectional)
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    prompt_len = len(output.prompt_token_ids)
    assert log_probs.shape[0] == prompt_len + MAX_TOKENS - 1
    for t, position in enumerate(completion.logprobs):
        for token, logprob in position.items():
            assert logprob.logprob == pytest.approx(float(log_probs[prompt_len - 1 + t, token]), abs=1e-4)


def make_llm(tiny: TinyGemma3, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 128,
              "limit_mm_per_prompt": {"image": 2}, **kwargs}
    return LLM(str(tiny.path), **kwargs)


def cases(images):
    g, s = images["gradient"], images["shapes"]
    return [(ONE, [g]), (ONE, [s]), (TWO, [g, s])]


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 6},  # chunks of 6 tokens: an image's 16 placeholders span three or four steps
    {"max_num_batched_tokens": 6, "num_gpu_blocks_override": 26, "max_num_seqs": 4},  # and preempted, recomputed
], ids=["plain", "chunked_prefill", "chunked_and_preempted"])
def test_greedy_tokens_and_logprobs_match_transformers(tiny_gemma3, images, engine_kwargs):
    llm = make_llm(tiny_gemma3, **engine_kwargs)
    outputs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases(images)], greedy(),
                           use_tqdm=False)
    for (text, imgs), output in zip(cases(images), outputs):
        image_token = tiny_gemma3.hf_model.config.image_token_id
        assert output.prompt_token_ids.count(image_token) == NUM_IMAGE_TOKENS * len(imgs)
        assert_matches_hf(tiny_gemma3, output, text, imgs)
    if "num_gpu_blocks_override" in engine_kwargs:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the picture matters
    llm.shutdown()


def test_text_only_prompt_matches_transformers(tiny_gemma3):
    llm = make_llm(tiny_gemma3)
    (output,) = llm.generate("User: hello there, robot. Model:", greedy(), use_tqdm=False)
    ids = torch.tensor([output.prompt_token_ids])
    with torch.inference_mode():
        full = tiny_gemma3.hf_model.generate(input_ids=ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
    assert list(output.outputs[0].token_ids) == full[ids.shape[1]:].tolist()
    llm.shutdown()


def test_prefix_cache_hits_for_the_same_image_and_misses_for_another(tiny_gemma3, images):
    llm = make_llm(tiny_gemma3)
    g, s = images["gradient"], images["shapes"]
    try:
        first, same, other = (llm.generate({"prompt": ONE, "multi_modal_data": {"image": i}}, greedy(),
                                           use_tqdm=False)[0] for i in (g, g, s))
    finally:
        llm.shutdown()
    image_start = first.prompt_token_ids.index(tiny_gemma3.hf_model.config.image_token_id)
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens > image_start + NUM_IMAGE_TOKENS  # the blocks holding the image are reused
    assert other.num_cached_tokens <= image_start  # only the text before the image
    assert_matches_hf(tiny_gemma3, same, ONE, [g])
    assert_matches_hf(tiny_gemma3, other, ONE, [s])


def test_tensor_parallel_matches_transformers(tiny_gemma3, images):
    """TP=2: each rank runs half of the SigLIP tower's heads (the pooled projector is replicated) and of the decoder."""
    llm = make_llm(tiny_gemma3, tensor_parallel_size=2, max_num_batched_tokens=6)
    try:
        outputs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases(images)], greedy(),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    for (text, imgs), output in zip(cases(images), outputs):
        assert_matches_hf(tiny_gemma3, output, text, imgs)


@pytest.mark.xfail(strict=True, reason="image tokens attend causally in llmplug; transformers' Gemma 3 lets each "
                                       "image's tokens see one another (the block mask of token_type_ids)")
def test_bidirectional_image_attention_is_not_there_yet(tiny_gemma3, images):
    llm = make_llm(tiny_gemma3)
    (output,) = llm.generate({"prompt": ONE, "multi_modal_data": {"image": images["gradient"]}}, greedy(),
                             use_tqdm=False)
    llm.shutdown()
    assert_matches_hf(tiny_gemma3, output, ONE, [images["gradient"]], bidirectional=True)
