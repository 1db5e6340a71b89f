"""Batch-invariant mode (model.batch_invariant), property-tested on tiny models of one architecture per family:
whatever the batch it runs in, the prefill chunk budget (max_num_batched_tokens 8..4096), prefix-cache hits
and preemptions, every request gets bitwise the tokens and log-probabilities it gets alone. The twin test
shows the property fails without the mode, so the property test is not vacuous."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmplug import LLM, SamplingParams
from llmplug.layers.int8_linear import int8_matmul_exact
from llmplug.testing import ParityCase, ParityRunner
from llmplug.testing.parity import BASE_ENGINE_KWARGS
from tests.models.cases import CASES

# one architecture per kind of block: dense GQA; sliding window + soft-capping; ALiBi; MoE with sinks and a
# window; latent attention + sigmoid-scored MoE; chunked local attention + MoE with a shared expert; a gated
# shared expert. Every other architecture's parity test checks the property too (llmplug.testing.parity: the
# batching-only variants bitwise equal); models with recurrent layers are outside the mode (refused below).
FAMILIES = [
    "LlamaForCausalLM",
    "Gemma2ForCausalLM",
    "BloomForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
    "Llama4ForCausalLM",
    "Qwen2MoeForCausalLM",
]
CASE = {case.name: case for case in CASES}
# int8 weights need torch._int_mm to be an exact integer matmul, which some kernel families are not (oneDNN
# capped at AVX2 sums in 16 bits); the engine then refuses quantization=int8 by name
NEEDS_EXACT_INT8 = pytest.mark.skipif(not int8_matmul_exact("cpu"), reason="no exact int8 matmul on this CPU")
SHARED_PREFIX = 12  # tokens every other prompt starts with: prefix-cache hits (block size 4)
MAX_TOKENS = 6
Result = tuple[list[int], list[float]]


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ParityRunner:
    return ParityRunner(tmp_path_factory.mktemp("invariance"))


def prompts_of(runner: ParityRunner, case: ParityCase) -> list[list[int]]:
    """The case's prompts, every other one behind a shared prefix, so that prefix caching has hits."""
    prompts = case.prompts(runner.checkpoint(case).hf_model.config.vocab_size)  # no transformers generate needed
    prefix = prompts[0][:SHARED_PREFIX]
    return [prefix + p if i % 2 else p for i, p in enumerate(prompts)]


def params_of(index: int) -> SamplingParams:
    """Greedy and seeded sampled requests, alternately; log-probabilities of the chosen tokens."""
    if index % 2:
        return SamplingParams(temperature=0.8, seed=100 + index, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def generate(runner: ParityRunner, case: ParityCase, prompts: dict[int, list[int]], **engine) -> dict[int, Result]:
    """Each listed prompt's tokens and their log-probabilities, all in one `generate` of an engine with `engine`."""
    kwargs = {**BASE_ENGINE_KWARGS, **case.engine_kwargs, "batch_invariant": True, **engine}
    llm = LLM(str(runner.checkpoint(case).path), **kwargs)
    try:
        order = list(prompts)
        requests = [{"prompt_token_ids": prompts[i]} for i in order]
        outputs = llm.generate(requests, [params_of(i) for i in order], use_tqdm=False)
    finally:
        llm.shutdown()
    results = {}
    for i, out in zip(order, outputs):
        completion = out.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        results[i] = (list(completion.token_ids), logprobs)
    return results


def alone(
    runner: ParityRunner, case: ParityCase, dtype: str, invariant: bool = True, quantization: str = "none"
) -> dict[int, Result]:
    """Every prompt alone (one engine, one request at a time, no chunking, no prefix caching)."""
    prompts = prompts_of(runner, case)
    kwargs = {**BASE_ENGINE_KWARGS, **case.engine_kwargs, "dtype": dtype, "batch_invariant": invariant,
              "enable_prefix_caching": False, "max_num_batched_tokens": 4096, "quantization": quantization}
    llm = LLM(str(runner.checkpoint(case).path), **kwargs)
    try:
        results = {}
        for i, prompt in enumerate(prompts):
            completion = llm.generate([{"prompt_token_ids": prompt}], params_of(i), use_tqdm=False)[0].outputs[0]
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
            results[i] = (list(completion.token_ids), logprobs)
    finally:
        llm.shutdown()
    return results


scenarios = st.fixed_dictionaries(
    {
        "order": st.permutations(range(6)).flatmap(lambda p: st.integers(2, 6).map(lambda n: list(p[:n]))),
        "budget": st.sampled_from([8, 13, 64, 4096]) | st.integers(8, 4096),
        "prefix_caching": st.booleans(),
        "tight_cache": st.booleans(),  # few KV blocks: requests are preempted and recomputed
    }
)


@pytest.mark.parametrize(
    ("family", "dtype", "quantization"),
    [(f, "bfloat16", "none") for f in FAMILIES]
    + [("LlamaForCausalLM", "float32", "none"), ("LlamaForCausalLM", "bfloat16", "int4"),
       pytest.param("LlamaForCausalLM", "bfloat16", "int8", marks=NEEDS_EXACT_INT8)],
)
def test_logits_and_tokens_do_not_depend_on_batch_chunks_prefix_hits_or_preemption(
    runner, family, dtype, quantization
) -> None:
    case = CASE[family]
    prompts = prompts_of(runner, case)
    expected = alone(runner, case, dtype, quantization=quantization)

    @settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(scenario=scenarios)
    def check(scenario: dict) -> None:
        engine = {"dtype": dtype, "max_num_batched_tokens": scenario["budget"],
                  "enable_prefix_caching": scenario["prefix_caching"], "quantization": quantization}
        if scenario["tight_cache"]:
            engine["num_gpu_blocks_override"] = 24
        got = generate(runner, case, {i: prompts[i] for i in scenario["order"]}, **engine)
        for i, result in got.items():
            assert result == expected[i], f"prompt {i} changed in {scenario}"

    check()


def test_without_the_mode_a_request_changes_with_its_batch(runner) -> None:
    """The non-invariant twin: the default attention paths (padded SDPA, per-batch decode lengths) and MKL's
    float32 matmul give the same prompts other log-probabilities in a batch, chunked, than alone."""
    case = CASE["LlamaForCausalLM"]
    prompts = prompts_of(runner, case)
    expected = alone(runner, case, "float32", invariant=False)
    got = generate(runner, case, dict(enumerate(prompts)), batch_invariant=False, max_num_batched_tokens=16)
    assert any(got[i] != expected[i] for i in got), "the default paths were batch invariant: the twin test is stale"


@pytest.mark.parametrize("quantization", ["int4", pytest.param("int8", marks=NEEDS_EXACT_INT8)])
def test_quantized_layers_keep_one_kernel_for_every_token_count_in_the_mode(runner, quantization) -> None:
    """The property test above runs these modes; here, that they really are on: with quantization=int4 (the mode
    asked for) every int4 layer takes the int4 kernel for any number of tokens, never its dense weight for a
    large step; with int8 every layer computes through int8 weights (its default turns the mode on)."""
    from llmplug.layers.int8_linear import Int8LinearMethod
    from llmplug.layers.quantization import Int4LinearMethod

    case = CASE["LlamaForCausalLM"]
    kwargs = {**BASE_ENGINE_KWARGS, "dtype": "bfloat16", "quantization": quantization}
    if quantization == "int4":
        kwargs["batch_invariant"] = True
    llm = LLM(str(runner.checkpoint(case).path), **kwargs)
    try:
        assert llm.llm_engine.config.model.batch_invariant is True
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        methods = [m.quant_method for m in model.modules() if hasattr(m, "quant_method")]
        if quantization == "int4":
            assert methods and all(isinstance(m, Int4LinearMethod) and m.max_tokens is None for m in methods), methods
        else:
            assert methods and all(isinstance(m, Int8LinearMethod) for m in methods), methods
        out = llm.generate([{"prompt_token_ids": list(range(5, 45))}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, True),  # the default: on
        ({"quantization": "auto"}, True),  # int4 copies for generated tokens, prompts dense: by position
        ({"quantization": "int4"}, False),  # int4 prompts only when asked for (batch_invariant: true)
        ({"quantization": "int8"}, True),  # an exact integer matmul, per-token scales
        ({"device.compile": True}, False),  # the compiled forward is not checked for invariance
        ({"runner": "pooling"}, False),  # no KV cache: prompts run whole
        ({"attention_backend": "triton"}, False),  # reduces in another order per batch
        ({"batch_invariant": False}, False),
        ({"case": "Mamba2ForCausalLM"}, False),  # recurrent layers: outside the mode
        ({"case": "BambaForCausalLM"}, False),
        ({"case": "DeepseekV3ForCausalLM"}, True),
    ],
)
def test_auto_turns_the_mode_on_only_where_it_holds(runner, settings, expected) -> None:
    """batch_invariant: auto (the default) is resolved at engine start, before any worker: on for the CPU's
    torch_sdpa with dense weights and a model of llmplug's layers without recurrent ones, off where a setting
    picks a kernel per batch or the model cannot hold it."""
    from llmplug.core.config import load_config
    from llmplug.core.plugins import PluginRegistry
    from llmplug.engine.llm_engine import prepare_config

    settings = dict(settings)
    path = str(runner.checkpoint(CASE[settings.pop("case", "LlamaForCausalLM")]).path)
    config = load_config(kwargs={"model": path, **settings}).config
    assert config.model.batch_invariant == settings.get("batch_invariant", "auto")
    resolved = prepare_config(config, PluginRegistry.from_config(config.plugins))
    assert resolved.model.batch_invariant is expected


def test_the_mode_refuses_an_attention_backend_without_it(runner) -> None:
    """Asked for explicitly, the mode is an error naming the backend, raised before the model loads."""
    from llmplug.core.config import load_config
    from llmplug.core.errors import ConfigError
    from llmplug.core.plugins import PluginRegistry
    from llmplug.engine.llm_engine import prepare_config

    path = str(runner.checkpoint(CASE["LlamaForCausalLM"]).path)
    config = load_config(kwargs={"model": path, "attention_backend": "triton", "batch_invariant": True}).config
    with pytest.raises(ConfigError, match="attention_backend='triton' does not"):
        prepare_config(config, PluginRegistry.from_config(config.plugins))


@pytest.mark.parametrize("family", ["Mamba2ForCausalLM", "BambaForCausalLM"])
def test_the_mode_refuses_a_model_with_recurrent_layers(runner, family) -> None:
    """A recurrent layer's chunked scan sums in an order that depends on the prefill chunks (and a preempted
    request recomputes by scan what it decoded step by step): asked for explicitly, the mode is an error that
    names why; the same model starts with the default (auto: off) and answers."""
    from llmplug.core.errors import ConfigError

    path = str(runner.checkpoint(CASE[family]).path)
    with pytest.raises(ConfigError, match="batch_invariant cannot hold.*recurrent layers"):
        LLM(path, **BASE_ENGINE_KWARGS, batch_invariant=True)
    llm = LLM(path, **BASE_ENGINE_KWARGS)
    try:
        assert llm.llm_engine.config.model.batch_invariant is False
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
