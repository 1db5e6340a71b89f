"""What the loader tests share: loading through the `llmplug.loaders` registry, our logits and greedy tokens,
and transformers' logits and greedy tokens for the same prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmplug import LLM, SamplingParams
from llmplug.core.config import EngineConfig, LoadConfig, ModelConfig
from llmplug.core.plugins import get_registry
from llmplug.testing.paged import PagedHarness

PROMPT = [3, 17, 42, 99, 7, 250, 128, 64, 5, 11, 200, 31]
GREEDY_PROMPTS = [[3, 17, 42, 99, 7], [250, 128, 64, 5, 11, 200, 31, 9, 1]]
MAX_TOKENS = 16


def load_model(path: Path | str, fmt: str, dtype: str = "float32", **load_fields: Any) -> torch.nn.Module:
    """Our model, built by the loader registered under `fmt` (found by entry point, as for any plugin)."""
    config = EngineConfig(model=ModelConfig(model=str(path), dtype=dtype), load=LoadConfig(format=fmt, **load_fields))
    return get_registry().load("llmplug.loaders", fmt)(config.load).load_model(config)


def our_logits(model: torch.nn.Module, tokens: list[int] = PROMPT) -> torch.Tensor:
    """[len(tokens), vocab] logits of one prompt through the paged KV cache."""
    harness = PagedHarness(model)
    harness.add("r", tokens)
    return harness.step([("r", len(tokens))])["r"]


def hf_logits(hf_model: torch.nn.Module, tokens: list[int] = PROMPT) -> torch.Tensor:
    """transformers' logits [len(tokens), vocab] of one prompt."""
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def greedy(path: Path | str, dtype: str = "float32", **engine: Any) -> list[list[int]]:
    """Greedy tokens of GREEDY_PROMPTS from the whole engine (LLM) in `dtype`, shut down after."""
    llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, block_size=4, **engine)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def our_greedy(path: Path | str, fmt: str, **load_fields: Any) -> list[list[int]]:
    """Greedy tokens of GREEDY_PROMPTS from the whole engine (LLM) with load format `fmt`."""
    return greedy(path, load={"format": fmt, **load_fields})


def hf_greedy(hf_model: torch.nn.Module) -> list[list[int]]:
    """transformers' greedy tokens of GREEDY_PROMPTS."""
    tokens = []
    for prompt in GREEDY_PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                do_sample=False, pad_token_id=0,
            )
        tokens.append(out[0, len(prompt):].tolist())
    return tokens


def truncate(file: Path, keep: float = 0.6) -> None:
    """Cut `file` to a fraction of its bytes, like an interrupted download."""
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def corrupt(file: Path, offset: int = 8, length: int = 64) -> None:
    """Overwrite `length` bytes at `offset` with 0xFF."""
    data = bytearray(file.read_bytes())
    data[offset : offset + length] = b"\xff" * length
    file.write_bytes(bytes(data))
