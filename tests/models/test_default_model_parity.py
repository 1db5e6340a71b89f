"""The embedded default model (SmolLM2 GGUF) against transformers' own load of the same GGUF file."""

from __future__ import annotations

import os

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.config import DEFAULT_MODEL
from llmplug.loaders.default_model import resolve_model_path

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "What is 12 times 12?",
    "Write one sentence about the moon.",
    "Which planet is known as the red planet?",
    "Translate 'good morning' into Spanish.",
    "What do bees make?",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_model(smollm2_transformers):
    """transformers' own load of the same GGUF file (tests/conftest.py: loaded once, shared with tests/loaders)."""
    assert smollm2_transformers.name_or_path == os.path.dirname(resolve_model_path(DEFAULT_MODEL))
    return smollm2_transformers


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", quantization="none")


@pytest.fixture(scope="module")
def chat_prompts(llm) -> list[dict]:
    return [llm.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]


def hf_greedy(hf_model, token_ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([token_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=hf_model.config.eos_token_id)
    return out[0, len(token_ids):].tolist()


def test_greedy_64_tokens_equal_transformers_for_8_chat_prompts(llm, hf_model, chat_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    ours = llm.generate(chat_prompts, params, use_tqdm=False)
    for prompt, out in zip(chat_prompts, ours):
        expected = hf_greedy(hf_model, prompt["prompt_token_ids"])
        got = list(out.outputs[0].token_ids)
        if got and got[-1] == hf_model.config.eos_token_id and expected[: len(got)] == got:
            continue  # both stopped at EOS; HF pads after it
        assert got == expected, f"prompt {prompt['prompt']!r}"


def test_logits_close_to_transformers_for_a_batch_of_chat_prompts(llm, hf_model, chat_prompts):
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, prompt_logprobs=1)
    ours = llm.generate(chat_prompts, params, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(chat_prompts, ours):
        ids = prompt["prompt_token_ids"]
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        for token_id, lp in out.outputs[0].logprobs[0].items():  # the next-token distribution
            worst = max(worst, abs(lp.logprob - float(ref[-1, token_id])))
        for pos, position in enumerate(out.prompt_logprobs[1:], start=1):  # every prompt position
            for token_id, lp in position.items():
                worst = max(worst, abs(lp.logprob - float(ref[pos - 1, token_id])))
    assert worst < 2e-3, f"max |logprob difference| = {worst}"


def test_answers_are_sensible_english(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
