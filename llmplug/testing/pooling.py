"""Pooling models through the whole engine against transformers, on a tiny random checkpoint.

A `PoolingParityCase` names a tiny transformers config of a pooling architecture (an encoder, a
`*ForSequenceClassification`) or of a causal LM run as an embedder (`engine_kwargs={"runner":
"pooling"}`). `PoolingParityRunner.check(case)` saves the checkpoint with transformers, pools the
case's prompts with `LLM.encode` (the model's default task, several prompts per step and across
steps) and asserts, prompt by prompt, within `case.atol` of transformers:

- embedding models: the L2-normalized CLS / MEAN / LAST row (the model's default pooling) of
  transformers' last hidden state;
- classifiers: transformers' logits (use_activation=False) and its softmax or sigmoid of them.

Prompts avoid the ids below 4 (padding and special tokens: RoBERTa places a pad token differently).
With `token_types=True` each prompt is a pair: its second half has token type 1 (cross-encoders).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import transformers
from transformers import PretrainedConfig

from llmplug.core.params import PoolingParams
from llmplug.testing.parity import BASE_ENGINE_KWARGS, _one_thread
from llmplug.testing.tiny import randomize_

__all__ = ["PoolingParityCase", "PoolingParityRunner", "PoolingReport"]

POOLING_PROMPT_LENGTHS = (3, 11, 7, 20, 1, 14, 29, 5)
FIRST_ORDINARY_ID = 4
# a step budget that makes the engine run the prompts over several steps, each whole
MULTI_STEP_KWARGS = {"max_num_batched_tokens": 32, "max_model_len": 64}


@dataclass(frozen=True)
class PoolingParityCase:
    """One pooling architecture (or flag combination) on a tiny random config."""

    name: str  # the test id; its part before the first '-' is the registered architecture it proves
    make_config: Callable[[], PretrainedConfig]
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    token_types: bool = False  # prompts are text pairs: second halves of token type 1
    prompt_lengths: tuple[int, ...] = POOLING_PROMPT_LENGTHS
    atol: float = 1e-4
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Random prompts of `prompt_lengths` ordinary tokens, the same for every run."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        return [torch.randint(FIRST_ORDINARY_ID, vocab_size, (n,), generator=generator).tolist()
                for n in self.prompt_lengths]


@dataclass(frozen=True)
class PoolingReport:
    """A passed check: the task and the worst difference from transformers."""

    case: str
    task: str
    max_diff: float


class PoolingParityRunner:
    """Runs pooling parity cases; each case's checkpoint is saved once per runner."""

    def __init__(self, workdir: str | Path) -> None:
        self.workdir = Path(workdir)
        self._saved: dict[str, tuple[Path, torch.nn.Module]] = {}

    def checkpoint(self, case: PoolingParityCase) -> tuple[Path, torch.nn.Module]:
        """(path, transformers model) of the case's tiny checkpoint, saved on first use."""
        if case.name not in self._saved:
            config = case.make_config()
            architecture = config.architectures[0]
            torch.manual_seed(case.seed)
            model = getattr(transformers, architecture)._from_config(config, dtype=torch.float32,
                                                                      attn_implementation="eager")
            model.eval()
            randomize_(model, case.seed)
            path = self.workdir / case.name
            model.save_pretrained(path)
            self._saved[case.name] = (path, model)
        return self._saved[case.name]

    def check(self, case: PoolingParityCase) -> PoolingReport:
        """Assert llmplug pools the case's prompts as transformers does (see the module doc)."""
        from llmplug import LLM

        path, hf_model = self.checkpoint(case)
        prompts = case.prompts(hf_model.config.vocab_size)
        inputs = [_prompt(p, case.token_types) for p in prompts]
        llm = LLM(str(path), **{**BASE_ENGINE_KWARGS, **MULTI_STEP_KWARGS, **case.engine_kwargs})
        try:
            task = llm.llm_engine.pooling.tasks[0]
            pooling_type = llm.llm_engine.pooling.pooling_type
            raw = llm.encode(inputs, PoolingParams(use_activation=False), use_tqdm=False)
            activated = llm.encode(inputs, use_tqdm=False) if task != "embed" else raw
        finally:
            llm.shutdown()
        worst = 0.0
        with torch.inference_mode(), _one_thread():
            for i, prompt in enumerate(inputs):
                expected_raw, expected = _reference(hf_model, prompt, task, pooling_type)
                worst = max(worst, _diff(raw[i].outputs.data, expected_raw), _diff(activated[i].outputs.data, expected))
        if not worst <= case.atol:
            raise AssertionError(f"{case.name} [{task}]: differs from transformers by up to {worst:.3g} > {case.atol}")
        return PoolingReport(case.name, task, worst)


def _prompt(token_ids: list[int], token_types: bool) -> dict[str, list[int]]:
    prompt = {"prompt_token_ids": token_ids}
    if token_types:
        half = len(token_ids) // 2
        prompt["token_type_ids"] = [0] * half + [1] * (len(token_ids) - half)
    return prompt


def _reference(
    hf_model: torch.nn.Module, prompt: dict, task: str, pooling_type: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (raw, activated) result for one prompt: embeddings are normalized in both."""
    ids = torch.tensor([prompt["prompt_token_ids"]])
    kwargs = {"token_type_ids": torch.tensor([prompt["token_type_ids"]])} if "token_type_ids" in prompt else {}
    if task == "embed":
        hidden = hf_model.base_model(ids, **kwargs).last_hidden_state[0].float()  # [T, H]
        row = {"CLS": hidden[0], "LAST": hidden[-1], "MEAN": hidden.mean(0)}[pooling_type]
        row = torch.nn.functional.normalize(row, dim=-1)
        return row, row
    logits = hf_model(ids, **kwargs).logits[0].float()
    return logits, (torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1))


def _diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    if got.shape != expected.shape:
        raise AssertionError(f"llmplug's result has shape {tuple(got.shape)}, transformers' {tuple(expected.shape)}")
    return float((got - expected).abs().max())
