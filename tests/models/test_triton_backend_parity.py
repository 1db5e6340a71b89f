"""The triton attention backend, forced on the CPU under triton's interpreter, gives the same greedy tokens as
torch_sdpa through the whole engine: prompts crossing 16-token blocks, chunked prefill mixed with decodes,
and (variant "all_kernels") with every layer on its Triton kernel too."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, Gemma2Config

from llmplug import LLM, SamplingParams
from llmplug.core.plugins import get_registry
from llmplug.layers.kernels import KERNELS_ENV

from .tiny_models import make_tiny, randomize_

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


@pytest.fixture(scope="module")
def sdpa_greedy(tiny_llama) -> Callable[..., list[list[int]]]:
    """torch_sdpa's greedy tokens of the tiny Llama's prompts (llmplug's kernels off) under some engine settings,
    run once per settings: "attention" and "all_kernels" compare with the same reference."""
    token_prompts = prompts(tiny_llama.hf_model.config.vocab_size)

    @functools.cache
    def run(engine: frozenset) -> list[list[int]]:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(KERNELS_ENV, "0")
            return greedy(tiny_llama.path, "torch_sdpa", token_prompts, **dict(engine))

    return lambda **engine: run(frozenset(engine.items()))


@pytest.mark.parametrize(
    "engine,kernels",
    [
        pytest.param({}, "0", id="attention"),
        pytest.param({"max_num_batched_tokens": 20}, "0", id="chunked_prefill"),
        pytest.param({}, "1", id="all_kernels", marks=pytest.mark.slow),
    ],
)
def test_llama_greedy_tokens_equal_torch_sdpa(
    tiny_llama, sdpa_greedy, monkeypatch, engine: dict, kernels: str
) -> None:
    token_prompts = prompts(tiny_llama.hf_model.config.vocab_size)
    expected = sdpa_greedy(**engine)
    monkeypatch.setenv(KERNELS_ENV, kernels)
    assert greedy(tiny_llama.path, "triton", token_prompts, **engine) == expected


# Gemma2 (sliding window + logit soft-cap) and Bloom (ALiBi) exercise the kernel's features through a real
# model. They run as soon as those architectures are registered (model breadth I); until then they skip.
FEATURE_FAMILIES = {
    "Gemma2ForCausalLM": lambda: Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        attn_logit_softcapping=2.0, max_position_embeddings=256,
    ),
    "BloomForCausalLM": lambda: BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4),
}


@pytest.mark.parametrize("architecture", sorted(FEATURE_FAMILIES))
def test_feature_families_greedy_tokens_equal_torch_sdpa(architecture: str, tmp_path, monkeypatch) -> None:
    if architecture not in get_registry().names("llmplug.models"):
        pytest.skip(f"{architecture} is not registered yet (model breadth I)")
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(FEATURE_FAMILIES[architecture](), dtype=torch.float32)
    randomize_(hf_model)
    hf_model.save_pretrained(tmp_path)
    token_prompts = prompts(256)  # 8 prompts, several longer than Gemma2's window of 8
    monkeypatch.setenv(KERNELS_ENV, "0")
    context = {"max_model_len": 256}  # Bloom's config has no max_position_embeddings (ALiBi)
    assert greedy(tmp_path, "triton", token_prompts, **context) == greedy(tmp_path, "torch_sdpa", token_prompts, **context)
