"""Every pooling architecture embeds or classifies as transformers does, through the whole engine
(llmplug.testing pooling parity cases; several prompts per step, over several steps)."""

from __future__ import annotations

import time

import pytest
import torch

from llmplug import LLM
from llmplug.testing import PoolingParityCase, PoolingParityRunner
from llmplug.testing.parity import BASE_ENGINE_KWARGS

from .cases import POOLING_CASES


@pytest.fixture(scope="session")
def pooling_parity(tmp_path_factory: pytest.TempPathFactory) -> PoolingParityRunner:
    return PoolingParityRunner(tmp_path_factory.mktemp("pooling_parity"))


@pytest.mark.parametrize("case", POOLING_CASES, ids=lambda c: c.name)
def test_pooled_outputs_match_transformers(pooling_parity: PoolingParityRunner, case: PoolingParityCase) -> None:
    start = time.perf_counter()
    report = pooling_parity.check(case)
    print(f"{case.name} [{report.task}]: max |diff| {report.max_diff:.1e}, {time.perf_counter() - start:.2f} s")


def _case(name: str) -> PoolingParityCase:
    return next(case for case in POOLING_CASES if case.name == name)


def test_reward_is_the_score_head_on_every_token(pooling_parity: PoolingParityRunner) -> None:
    """LLM.reward (token_classify): transformers' `score` head on every token's hidden state, softmaxed."""
    path, hf_model = pooling_parity.checkpoint(_case("Qwen2ForSequenceClassification"))
    prompts = _case("Qwen2ForSequenceClassification").prompts(hf_model.config.vocab_size)[:3]
    llm = LLM(str(path), **BASE_ENGINE_KWARGS)
    try:
        rewards = llm.reward([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    finally:
        llm.shutdown()
    with torch.inference_mode():
        for prompt, out in zip(prompts, rewards):
            hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]  # [T, H]
            expected = torch.softmax(hf_model.score(hidden).float(), dim=-1)  # [T, num_labels]
            torch.testing.assert_close(out.outputs.data, expected, atol=1e-4, rtol=0)


def test_token_embed_is_every_hidden_state_normalized(pooling_parity: PoolingParityRunner) -> None:
    """LLM.encode(pooling_task="token_embed") of an encoder: transformers' last hidden states, each normalized."""
    path, hf_model = pooling_parity.checkpoint(_case("BertModel"))
    prompts = _case("BertModel").prompts(hf_model.config.vocab_size)[:3]
    llm = LLM(str(path), **BASE_ENGINE_KWARGS)
    try:
        outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], pooling_task="token_embed", use_tqdm=False)
    finally:
        llm.shutdown()
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            hidden = hf_model(torch.tensor([prompt])).last_hidden_state[0].float()  # [T, H]
            torch.testing.assert_close(out.outputs.data, torch.nn.functional.normalize(hidden, dim=-1),
                                       atol=1e-4, rtol=0)
