"""Greedy generation on several ranks against one rank (uniproc, TP=1) on the same tiny checkpoint.

The tiny models are chosen so that the parallel paths do real work: Llama with 3 layers (PP=2 splits
them 2 + 1) and a vocabulary of 255 (the vocab-parallel table is padded on the last TP rank); Qwen2
with tied embeddings (the last PP stage loads the embedding as its head) and 1 KV head (replicated
on both TP ranks).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from llmplug import LLM, SamplingParams
from tests.models.tiny_models import TinyModel, make_tiny

TINY_OVERRIDES = {
    "llama": {"vocab_size": 255, "num_hidden_layers": 3},
    "qwen2": {"num_key_value_heads": 1},
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
ENGINE_KWARGS = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": 4, "num_gpu_blocks_override": 64}


def make_parallel_tiny(name: str, path: Path) -> TinyModel:
    """The tiny `name` checkpoint with the overrides above."""
    return make_tiny(name, path, overrides=TINY_OVERRIDES[name])


def prompts() -> list[list[int]]:
    """Token prompts of different lengths (one spans several KV blocks and prefill chunks)."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 250, (n,), generator=generator).tolist() for n in (3, 9, 17, 30)]


def make_llm(tiny: TinyModel, **kwargs: Any) -> LLM:
    """An engine on the tiny checkpoint; kwargs choose the parallel sizes and the executor."""
    return LLM(str(tiny.path), **{**ENGINE_KWARGS, **kwargs})


def generate(llm: LLM) -> list[dict[str, Any]]:
    """Each prompt's greedy tokens and the logprobs of its generated and prompt tokens."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False)
    return [
        {
            "tokens": list(out.outputs[0].token_ids),
            "logprobs": [{t: lp.logprob for t, lp in pos.items()} for pos in out.outputs[0].logprobs],
            "prompt_logprobs": [{t: lp.logprob for t, lp in pos.items()} for pos in out.prompt_logprobs if pos],
        }
        for out in outputs
    ]


def reference(tiny: TinyModel) -> list[dict[str, Any]]:
    """The same generation on one rank, in this process."""
    llm = make_llm(tiny, distributed_executor_backend="uniproc")
    try:
        return generate(llm)
    finally:
        llm.shutdown()


def assert_matches(got: list[dict[str, Any]], expected: list[dict[str, Any]], atol: float = 1e-4) -> None:
    """Identical greedy tokens; the same top tokens with logprobs within `atol`."""
    assert [g["tokens"] for g in got] == [e["tokens"] for e in expected]
    for g, e in zip(got, expected):
        for kind in ("logprobs", "prompt_logprobs"):
            assert len(g[kind]) == len(e[kind]) > 0
            for got_pos, exp_pos in zip(g[kind], e[kind]):
                assert got_pos.keys() == exp_pos.keys()
                assert all(math.isclose(got_pos[t], exp_pos[t], abs_tol=atol) for t in exp_pos), (got_pos, exp_pos)
