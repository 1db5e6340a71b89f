"""The transformers backend runs architectures llmplug has no native plugin for: greedy tokens identical to
transformers' `generate` with chunked prefill and prefix caching; a native architecture forced through it
matches the native path; its embedding twin pools as transformers does; TP=2 through the model's own plan;
what it cannot run is refused by name."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import BartConfig, DiffLlamaConfig

from llmplug import LLM, SamplingParams
from llmplug.core.config import EngineConfig
from llmplug.core.errors import LlmplugError
from llmplug.loaders.default import DefaultLoader
from llmplug.layers.decoder.pooling import converted_class
from llmplug.plugins.models.transformers_backend import TransformersForCausalLM, TransformersForEmbedding
from llmplug.plugins.models.transformers_backend.tensor_parallel import apply_tp_plan
from llmplug.testing import ParityCase, ParityRunner, PoolingParityRunner
from llmplug.testing.parity import BASE_ENGINE_KWARGS

from .cases import CASES
from .cases_transformers_backend import BACKEND_POOLING_CASES, FAST_CASES, SLOW_CASES, TP_CASE, backend_case

# a step budget below the longer prompts (chunked prefill); prefix caching is on by default
CHUNKED = {**BASE_ENGINE_KWARGS, "max_num_batched_tokens": 8, "enable_prefix_caching": True}


@pytest.fixture(scope="session")
def parity(tmp_path_factory: pytest.TempPathFactory) -> ParityRunner:
    return ParityRunner(tmp_path_factory.mktemp("transformers_backend"))


def generate_twice(parity: ParityRunner, case: ParityCase, **engine: object) -> tuple[list, list]:
    """The case's prompts generated twice by one engine (the second time from the prefix cache)."""
    prompts = [{"prompt_token_ids": p} for p in parity.reference(case).prompts]
    params = SamplingParams(temperature=0.0, max_tokens=case.max_new_tokens, ignore_eos=True)
    llm = LLM(str(parity.checkpoint(case).path), **{**CHUNKED, **engine})
    try:
        return llm.generate(prompts, params, use_tqdm=False), llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()


def model_class(path: str, model_impl: str = "auto") -> type:
    """The class the engine's loader picks for the checkpoint at `path`."""
    loader = DefaultLoader(EngineConfig().load)
    return loader.get_model_class(loader.load_hf_config(EngineConfig(model={"model": path}).model), model_impl)


def check_greedy(parity: ParityRunner, case: ParityCase, **engine: object) -> None:
    reference = parity.reference(case)
    first, second = generate_twice(parity, case, **engine)
    for i, prompt in enumerate(reference.prompts):
        assert list(first[i].outputs[0].token_ids) == reference.tokens[i], f"{case.name} prompt {i}"
        assert list(second[i].outputs[0].token_ids) == reference.tokens[i], f"{case.name} prompt {i}, cached"
        if len(prompt) > BASE_ENGINE_KWARGS["block_size"]:
            assert second[i].num_cached_tokens > 0, f"{case.name} prompt {i}: the second run hit no cached block"


def _greedy_matches_transformers(parity: ParityRunner, case: ParityCase) -> None:
    start = time.perf_counter()
    assert model_class(str(parity.checkpoint(case).path)) is TransformersForCausalLM  # no native plugin: the backend
    check_greedy(parity, case)
    print(f"{case.name}: {time.perf_counter() - start:.1f} s")


@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: c.name)
def test_greedy_tokens_match_transformers_with_chunked_prefill_and_prefix_cache(parity, case) -> None:
    _greedy_matches_transformers(parity, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: c.name)
def test_greedy_tokens_match_transformers_more_architectures(parity, case) -> None:
    _greedy_matches_transformers(parity, case)


def test_a_native_architecture_through_the_backend_generates_as_the_native_path(parity) -> None:
    case = next(c for c in CASES if c.name == "LlamaForCausalLM")
    path = str(parity.checkpoint(case).path)
    assert model_class(path, "transformers") is TransformersForCausalLM
    assert model_class(path) is not TransformersForCausalLM  # auto: Llama is native
    backend, _ = generate_twice(parity, case, model_impl="transformers")
    native, _ = generate_twice(parity, case, model_impl="native")
    assert [o.outputs[0].token_ids for o in backend] == [o.outputs[0].token_ids for o in native]
    assert [list(o.outputs[0].token_ids) for o in backend] == parity.reference(case).tokens


@pytest.mark.parametrize("case", BACKEND_POOLING_CASES, ids=lambda c: c.name)
def test_embedding_twin_pools_as_transformers(tmp_path_factory, case) -> None:
    runner = PoolingParityRunner(tmp_path_factory.mktemp("backend_pooling"))
    path, _ = runner.checkpoint(case)
    assert converted_class(model_class(str(path)), "embed") is TransformersForEmbedding
    report = runner.check(case)
    assert report.task == "embed" and report.max_diff <= 1e-4


@pytest.mark.slow
def test_tensor_parallel_through_the_model_plan_matches_transformers(parity) -> None:
    case = next(c for c in [*FAST_CASES, *SLOW_CASES] if c.name == TP_CASE)
    parity.check(case, "tp2")


def test_a_model_without_a_tensor_parallel_plan_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="BitNetForCausalLM has no tensor-parallel plan"):
        apply_tp_plan(torch.nn.Module(), None, torch.device("cpu"), "BitNetForCausalLM")


def _write_config(path, config, architecture: str) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config.to_dict() | {"architectures": [architecture]}))
    return str(path)


@pytest.mark.parametrize(
    ("config_class", "architecture", "why"),
    [
        (BartConfig, "NoSuchForCausalLM", "'NoSuchForCausalLM' is not registered natively"),
        (BartConfig, "BartForCausalLM", "BartForCausalLM does not support the attention interface"),
        (DiffLlamaConfig, "DiffLlamaForCausalLM", "DiffLlamaForCausalLM gives other tokens than transformers"),
    ],
)
def test_what_the_backend_cannot_run_is_refused_by_name_and_the_next_model_runs(
    parity, tmp_path, config_class, architecture, why
) -> None:
    path = _write_config(tmp_path / architecture, config_class(vocab_size=64), architecture)
    with pytest.raises(LlmplugError, match=why):
        LLM(path, **BASE_ENGINE_KWARGS)
    check_greedy(parity, FAST_CASES[0])


def test_native_only_refuses_an_architecture_without_a_native_plugin(parity) -> None:
    with pytest.raises(LlmplugError, match="BitNetForCausalLM"):
        model_class(str(parity.checkpoint(backend_case("bitnet")).path), "native")


def test_the_tensor_parallel_plan_turns_planned_linears_into_parallel_layers() -> None:
    from transformers import AutoModel

    from llmplug.layers.linear import ColumnParallelLinear, RowParallelLinear

    config = backend_case("apertus1p5_text").make_config()
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    apply_tp_plan(model, config.base_model_tp_plan, torch.device("cpu"), "Apertus1p5TextModel")
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert [type(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.up_proj)] == [ColumnParallelLinear] * 4
    assert [type(m) for m in (attn.o_proj, mlp.down_proj)] == [RowParallelLinear] * 2
    assert type(attn.q_norm).__name__.endswith("RMSNorm")  # replicated: left whole


def test_model_impl_is_a_config_field_with_a_flag_and_refuses_other_values() -> None:
    from llmplug.core.config import FLAG_PATHS

    assert FLAG_PATHS["--model-impl"] == "model.model_impl"
    assert EngineConfig(model={"model_impl": "transformers"}).model.model_impl == "transformers"
    with pytest.raises(ValueError, match="model_impl"):
        EngineConfig(model={"model_impl": "vllm"})
