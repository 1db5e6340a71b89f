"""LoRA adapters against peft's merged models: a batch mixing three adapters and the base model gives each
request the tokens and logits of its own adapter, through the model and through the whole engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.config import LoRAConfig
from llmplug.lora.manager import LoRAManager
from llmplug.testing import PagedHarness
from llmplug.testing.parity import BASE_ENGINE_KWARGS
from tests.models.tiny_models import TinyModel

from .adapters import Adapter, greedy_reference

ATOL = 1e-4
MIXED = (None, "qv8", "mlp16", "all8")  # the base model and three adapters, in one batch
PROMPT_LENS = (9, 5, 14, 7, 3, 11, 6, 13)
MAX_NEW_TOKENS = 12


def prompts(vocab: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lens]


def as_inputs(batch: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in batch]


def reference_model(base: TinyModel, adapters: dict[str, Adapter], name: str | None) -> torch.nn.Module:
    return base.hf_model if name is None else adapters[name].merged


def lora_llm(base: TinyModel, **kwargs) -> LLM:
    return LLM(str(base.path), **{**BASE_ENGINE_KWARGS, "enable_lora": True, "max_lora_rank": 16, **kwargs})


def check_mixed_logits(base: TinyModel, adapters: dict[str, Adapter], mixed: tuple[str | None, ...]) -> None:
    """One prefill step of a batch whose request i uses adapter mixed[i]: logits within ATOL of peft's."""
    model = base.load()
    manager = LoRAManager(model, LoRAConfig(enable_lora=True, max_loras=4), torch.float32, torch.device("cpu"))
    requests = {name: adapters[name].request(i + 1) for i, name in enumerate(a for a in mixed if a)}
    for request in requests.values():
        manager.add_adapter(request)
    harness = PagedHarness(model)
    batch = prompts(base.hf_model.config.vocab_size, PROMPT_LENS[: len(mixed)])
    names = [f"r{i}" for i in range(len(batch))]
    for name, p in zip(names, batch):
        harness.add(name, p)
    loras = [requests.get(a) for a in mixed]
    mapping = manager.mapping(loras, np.array([len(p) for p in batch]))
    out = harness.step([(name, len(p)) for name, p in zip(names, batch)], mapping)
    worst = 0.0
    for name, prompt, adapter in zip(names, batch, mixed):
        with torch.no_grad():
            expected = reference_model(base, adapters, adapter)(torch.tensor([prompt])).logits[0]
        worst = max(worst, (out[name] - expected).abs().max().item())
    print(f"{base.name} {mixed}: max abs logit diff {worst:.2e}")
    assert worst < ATOL


def check_mixed_greedy(base: TinyModel, adapters: dict[str, Adapter], mixed: tuple[str | None, ...]) -> None:
    """Through the engine, request i with adapter mixed[i % len(mixed)]: peft's greedy tokens, logprobs within ATOL."""
    llm = lora_llm(base)
    try:
        batch = prompts(base.hf_model.config.vocab_size)
        names = [mixed[i % len(mixed)] for i in range(len(batch))]
        ids = {name: i + 1 for i, name in enumerate(a for a in mixed if a)}
        loras = [None if n is None else adapters[n].request(ids[n]) for n in names]
        params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, logprobs=3, prompt_logprobs=3)
        outputs = llm.generate(as_inputs(batch), params, lora_request=loras, use_tqdm=False)
    finally:
        llm.shutdown()
    worst, differs_from_base = 0.0, 0
    for prompt, name, output in zip(batch, names, outputs):
        tokens, log_probs = greedy_reference(reference_model(base, adapters, name), prompt, MAX_NEW_TOKENS)
        got = output.outputs[0]
        assert list(got.token_ids) == tokens, f"{base.name} adapter {name}"
        rows = [(j, lp) for j, lp in enumerate(output.prompt_logprobs[1:])]
        rows += [(len(prompt) - 1 + t, lp) for t, lp in enumerate(got.logprobs)]
        worst = max(worst, max(abs(v.logprob - log_probs[row, tok].item()) for row, lp in rows for tok, v in lp.items()))
        base_tokens, _ = greedy_reference(base.hf_model, prompt, MAX_NEW_TOKENS)
        differs_from_base += name is not None and tokens != base_tokens
    assert worst < ATOL
    assert differs_from_base >= 4, "the adapters barely change the model: the test would not see them ignored"


def test_mixed_batch_logits_match_peft_merged_models(base: TinyModel, adapters: dict[str, Adapter]) -> None:
    check_mixed_logits(base, adapters, MIXED)


def test_mixed_batch_generates_each_adapters_greedy_tokens(base: TinyModel, adapters: dict[str, Adapter]) -> None:
    check_mixed_greedy(base, adapters, MIXED)
