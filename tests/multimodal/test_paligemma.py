"""PaliGemma against transformers on a tiny random checkpoint (SigLIP 32x32, patch 8: 16 image tokens; a 2-layer
Gemma decoder) and drawn pictures: greedy tokens equal and log-probabilities within 1e-4 (float32), the whole prompt
attending both ways as transformers' prefix-LM mask makes it (`token_type_ids` 0 over the prompt) — plain, with a
prompt that waits a step for the budget to hold it whole, preempted, and a prefix-cache lookup that must not reuse a
prompt's blocks, and tensor parallel (2 ranks); and a prompt longer than the step's budget refused by its size."""

from __future__ import annotations

import pytest
import torch

from llmplug import SamplingParams
from llmplug.core.errors import InvalidRequestError
from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import TinyVLM

MAX_TOKENS = 6
NUM_IMAGE_TOKENS = 16
PROMPTS = ["<image>caption en", "<image>answer en what is in the picture?"]


@pytest.fixture(scope="module")
def tiny_paligemma(tmp_path_factory) -> TinyVLM:
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
    return TinyVLM(path, processor, model)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def case(tiny_paligemma, images) -> MultimodalParityCase:
    """48 tokens a step: the first prompt (25 tokens) runs whole, the second (25) waits for a step that holds it
    whole, and so does the third (44); with 15 KV blocks of 4, requests are preempted and recomputed.
    transformers' `generate` takes the processor's `token_type_ids` (0: the prompt, a bidirectional prefix)."""
    prompts = (MultimodalPrompt(PROMPTS[0], (images["gradient"],)), MultimodalPrompt(PROMPTS[0], (images["shapes"],)),
               MultimodalPrompt(PROMPTS[1], (images["shapes"],)))
    return MultimodalParityCase("PaliGemmaForConditionalGeneration", tiny_paligemma.path, tiny_paligemma.processor,
                                tiny_paligemma.hf_model, prompts, chunk_budget=48, preemption_blocks=15,
                                max_tokens=MAX_TOKENS)


def test_greedy_tokens_and_logprobs_match_transformers(mm_parity, case):
    report = mm_parity.check(case, "plain")
    assert report.num_preemptions == 0
    for output in report.outputs:
        assert output.prompt_token_ids.count(case.image_token_id()) == NUM_IMAGE_TOKENS


def test_prompts_wait_and_are_preempted_never_a_prefix_cache_hit_and_one_longer_than_the_budget_is_refused(
        mm_parity, case, images):
    """One engine of 48 tokens a step and 15 blocks: the prompts wait for a step that holds each whole, preempted;
    a prompt's K/V depend on all of it, so the same prompt again recomputes it whole (a hit would end inside it); a
    prompt longer than the step's budget is refused by its size."""
    with mm_parity.engine(case, "preemption") as llm:
        mm_parity.check(case, "preemption", llm)
        (again,) = mm_parity.generate(case, llm, case.prompts[:1])
        with pytest.raises(InvalidRequestError, match=r"span of \d+ tokens \(at 0\).*max_num_batched_tokens=48"):
            llm.generate({"prompt": PROMPTS[1] + " and the colours?",
                          "multi_modal_data": {"image": images["gradient"]}}, greedy(), use_tqdm=False)
    assert again.num_cached_tokens == 0
    mm_parity.assert_matches(case, again, case.prompts[0])


def test_tensor_parallel_matches_transformers(mm_parity, case):
    """TP=2: each rank runs half of the SigLIP tower's heads and of the decoder; the prompts wait for 48-token steps."""
    mm_parity.check(case, "tp2")
