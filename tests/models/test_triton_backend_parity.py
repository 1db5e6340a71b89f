"""The triton attention backend, forced on the CPU under triton's interpreter, gives the same greedy tokens as
torch_sdpa through the whole engine: prompts crossing 16-token blocks, chunked prefill mixed with decodes,
and (variant "all_kernels") with every layer on its Triton kernel too."""

from __future__ import annotations

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.layers.kernels import KERNELS_ENV

from .tiny_models import ARCHS, make_tiny

MAX_TOKENS = 12
PROMPT_LENS = (3, 15, 16, 17, 33, 1, 24, 9)  # 8 prompts, around and across block boundaries
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def greedy(path, backend: str, token_prompts: list[list[int]], **engine) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, attention_backend=backend, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama_triton"))


@pytest.mark.parametrize(
    "engine,kernels",
    [
        pytest.param({}, "0", id="attention"),
        pytest.param({"max_num_batched_tokens": 20}, "0", id="chunked_prefill"),
        pytest.param({}, "1", id="all_kernels", marks=pytest.mark.slow),
    ],
)
def test_llama_greedy_tokens_equal_torch_sdpa(tiny_llama, monkeypatch, engine: dict, kernels: str) -> None:
    token_prompts = prompts(tiny_llama.hf_model.config.vocab_size)
    monkeypatch.setenv(KERNELS_ENV, "0")
    expected = greedy(tiny_llama.path, "torch_sdpa", token_prompts, **engine)
    monkeypatch.setenv(KERNELS_ENV, kernels)
    assert greedy(tiny_llama.path, "triton", token_prompts, **engine) == expected


# Gemma2 (sliding window + logit soft-cap) and Bloom (ALiBi) exercise the kernel's features through a real
# model; they run as soon as their tiny builders are in tests/models/tiny_models.py ARCHS.
@pytest.mark.parametrize("arch", ["gemma2", "bloom"])
def test_feature_families_greedy_tokens_equal_torch_sdpa(arch: str, tmp_path_factory, monkeypatch) -> None:
    if arch not in ARCHS:
        pytest.skip(f"no tiny {arch} builder in tests/models/tiny_models.py yet (model breadth I)")
    tiny = make_tiny(arch, tmp_path_factory.mktemp(f"{arch}_triton"))
    token_prompts = prompts(tiny.hf_model.config.vocab_size)
    monkeypatch.setenv(KERNELS_ENV, "0")
    assert greedy(tiny.path, "triton", token_prompts) == greedy(tiny.path, "torch_sdpa", token_prompts)
