"""PaliGemma against transformers on a tiny random checkpoint (SigLIP 32x32, patch 8: 16 image tokens; a 2-layer
Gemma decoder) and drawn pictures: greedy tokens equal and log-probabilities within 1e-4 (float32), the whole prompt
attending both ways as transformers' prefix-LM mask makes it (`token_type_ids` 0 over the prompt) — plain, with a
prompt that waits a step for the budget to hold it whole, preempted, and a prefix-cache lookup that must not reuse a
prompt's blocks; and a prompt longer than the step's budget refused by its size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from tests.models.tiny_models import train_llama_tokenizer

MAX_TOKENS = 6
NUM_IMAGE_TOKENS = 16
PROMPTS = ["<image>caption en", "<image>answer en what is in the picture?"]


@dataclass
class TinyPaliGemma:
    path: Path
    processor: object
    hf_model: torch.nn.Module


@pytest.fixture(scope="module")
def tiny_paligemma(tmp_path_factory) -> TinyPaliGemma:
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    path = tmp_path_factory.mktemp("tiny_paligemma")
    tokenizer = train_llama_tokenizer(path / "tokenizer")
    image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    image_processor.image_seq_length = NUM_IMAGE_TOKENS
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)  # adds <image>
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8, vision_use_head=False)
    text = GemmaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    config = PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=processor.image_token_id,
                             projection_dim=64, hidden_size=64, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the init's, so that the picture matters
        for param in model.parameters():
            param.normal_(0, 0.1)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return TinyPaliGemma(path, processor, model)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


_references: dict = {}


def hf_reference(tiny: TinyPaliGemma, text: str, image) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and log-softmax rows over prompt + tokens: the prompt a bidirectional prefix
    (`token_type_ids` 0), the generated tokens causal (1); computed once per prompt and image."""
    key = (text, id(image))
    if key not in _references:
        inputs = dict(tiny.processor(text=text, images=image, return_tensors="pt"))
        inputs.pop("labels")
        with torch.inference_mode():
            full = tiny.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
            token_type_ids = torch.nn.functional.pad(inputs["token_type_ids"], (0, MAX_TOKENS - 1), value=1)
            logits = tiny.hf_model(input_ids=full[None, :-1], pixel_values=inputs["pixel_values"],
                                   token_type_ids=token_type_ids).logits[0]
        _references[key] = full[inputs["input_ids"].shape[1]:].tolist(), torch.log_softmax(logits.float(), -1)
    return _references[key]


def assert_matches_hf(tiny: TinyPaliGemma, output, text: str, image) -> None:
    tokens, log_probs = hf_reference(tiny, text, image)
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    prompt_len = len(output.prompt_token_ids)
    assert log_probs.shape[0] == prompt_len + MAX_TOKENS - 1
    for t, position in enumerate(completion.logprobs):
        for token, logprob in position.items():
            assert logprob.logprob == pytest.approx(float(log_probs[prompt_len - 1 + t, token]), abs=1e-4)


def make_llm(tiny: TinyPaliGemma, **kwargs) -> LLM:
    return LLM(str(tiny.path), **{"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 64, **kwargs})


def cases(images):
    return [(PROMPTS[0], images["gradient"]), (PROMPTS[0], images["shapes"]), (PROMPTS[1], images["shapes"])]


@pytest.mark.parametrize("engine_kwargs", [
    {},
    # 48 tokens a step: the first prompt (25 tokens) runs whole, the second (25) waits for a step that holds it
    # whole, and so does the third (44); with 15 blocks of 4, requests are preempted and recomputed
    {"max_num_batched_tokens": 48, "num_gpu_blocks_override": 15},
], ids=["plain", "prompts_wait_and_preempted"])
def test_greedy_tokens_and_logprobs_match_transformers(tiny_paligemma, images, engine_kwargs):
    llm = make_llm(tiny_paligemma, **engine_kwargs)
    try:
        outputs = llm.generate([{"prompt": t, "multi_modal_data": {"image": i}} for t, i in cases(images)], greedy(),
                               use_tqdm=False)
        preemptions = llm.llm_engine.engine_core.scheduler.num_preemptions
    finally:
        llm.shutdown()
    for (text, image), output in zip(cases(images), outputs):
        assert output.prompt_token_ids.count(tiny_paligemma.hf_model.config.image_token_id) == NUM_IMAGE_TOKENS
        assert_matches_hf(tiny_paligemma, output, text, image)
    assert (preemptions > 0) == ("num_gpu_blocks_override" in engine_kwargs)
    gradient, shapes = (o.outputs[0] for o in outputs[:2])  # the picture matters: another answer, or other odds
    first = gradient.token_ids[0]
    assert gradient.token_ids != shapes.token_ids or abs(
        gradient.logprobs[0][first].logprob - shapes.logprobs[0][first].logprob) > 1e-2


def test_a_prompt_is_never_a_prefix_cache_hit_and_one_longer_than_the_budget_is_refused(tiny_paligemma, images):
    """A prompt's K/V depend on all of it: the same prompt again recomputes it whole (a hit would end inside it)."""
    llm = make_llm(tiny_paligemma, max_num_batched_tokens=32)
    text, image = PROMPTS[0], images["gradient"]
    try:
        first, again = (llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, greedy(),
                                     use_tqdm=False)[0] for _ in range(2))
        with pytest.raises(InvalidRequestError, match=r"span of \d+ tokens \(at 0\).*max_num_batched_tokens=32"):
            llm.generate({"prompt": PROMPTS[1] + " and the colours, please?", "multi_modal_data": {"image": image}},
                         greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    assert again.num_cached_tokens == 0
    assert_matches_hf(tiny_paligemma, again, text, image)
