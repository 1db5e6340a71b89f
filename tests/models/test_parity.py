"""Every registered architecture generates what transformers generates (llmplug.testing parity cases)."""

from __future__ import annotations

import time

import pytest

from llmplug.testing import ParityCase, ParityRunner, Variant

from .cases import CASES, EP_CASES, PP_CASES, TP_CASES

BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="session")
def parity(tmp_path_factory: pytest.TempPathFactory) -> ParityRunner:
    return ParityRunner(tmp_path_factory.mktemp("parity"))


# every case with its prompts chunked and its requests preempted in one run (against transformers); once per family
# module also plain (every prompt prefilled in one step, no preemption), bitwise the same as the chunked run
VARIANT_CASES = [(case, variant) for case in CASES
                 for variant in ("plain", "chunked_preemption")
                 if variant != "plain" or case.name in TP_CASES]


@pytest.mark.parametrize("case,variant", VARIANT_CASES, ids=lambda v: v if isinstance(v, str) else v.name)
def test_greedy_tokens_and_logprobs_match_transformers(parity: ParityRunner, case: ParityCase, variant: str) -> None:
    start = time.perf_counter()
    report = parity.check(case, variant)
    print(
        f"{case.name} [{variant}]: max |logprob diff| {report.max_logprob_diff:.1e}, "
        f"preemptions {report.num_preemptions}, {time.perf_counter() - start:.2f} s"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", TP_CASES)
def test_tensor_parallel_greedy_tokens_and_logprobs_match_transformers(parity: ParityRunner, name: str) -> None:
    parity.check(BY_NAME[name], "tp2")


@pytest.mark.slow
@pytest.mark.parametrize("name", PP_CASES)
def test_pipeline_parallel_greedy_tokens_and_logprobs_match_transformers(parity: ParityRunner, name: str) -> None:
    parity.check(BY_NAME[name], "pp2")


@pytest.mark.slow
@pytest.mark.parametrize("name", EP_CASES)
def test_expert_parallel_greedy_tokens_and_logprobs_match_transformers(parity: ParityRunner, name: str) -> None:
    parity.check(BY_NAME[name], Variant("ep2", {"tensor_parallel_size": 2, "enable_expert_parallel": True}))


# torch.compile costs tens of CPU-seconds per model here: a few families that cover the shared blocks
# (GQA + rotary + gated MLP; window + soft-cap + sandwich norms; ALiBi + LayerNorm + fused qkv)
COMPILED_CASES = ["LlamaForCausalLM", "Gemma2ForCausalLM", "BloomForCausalLM"]


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED_CASES)
def test_compiled_forward_greedy_tokens_and_logprobs_match_transformers(parity: ParityRunner, name: str) -> None:
    parity.check(BY_NAME[name], "compiled")
