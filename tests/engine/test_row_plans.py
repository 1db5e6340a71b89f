"""The engine holds batch invariance on kernels whose rows depend on how many share a call, or says it cannot.

oneDNN's packed linear is replaced here by test doubles that round otherwise for some row counts or positions
(standing in for kernel families this machine may not have, such as AMX's): the probe at packing time must
catch them, the engine must then pad or tile rows so that answers still do not depend on the batch, and where
nothing holds, `auto` turns the mode off with one log line naming the weight and `true` is refused by name."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ConfigError
from llmplug.layers import packed_linear
from llmplug.layers.decoder.native_stack import NativeDecoderStack
from llmplug.testing import ParityRunner
from llmplug.testing.parity import BASE_ENGINE_KWARGS
from tests.models.cases import CASES

CASE = next(case for case in CASES if case.name == "LlamaForCausalLM")
REAL_KERNEL = packed_linear._packed_linear
PARAMS = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, logprobs=0)


def rounded_otherwise(y: torch.Tensor) -> torch.Tensor:
    """y with its low bits changed as another summation order would change them."""
    return (y + 1.0) - 1.0


def otherwise_above(rows: int):
    """A kernel that rounds otherwise when a call has more than `rows` rows (an M-dependent blocking)."""

    def kernel(x, packed, bias):
        y = REAL_KERNEL(x, packed, bias)
        return rounded_otherwise(y) if x.reshape(-1, x.shape[-1]).shape[0] > rows else y

    return kernel


def otherwise_at_odd_positions(x, packed, bias):
    """A kernel whose rounding depends on a row's position in the call: no plan holds."""
    y = REAL_KERNEL(x, packed, bias).clone()
    flat = y.view(-1, y.shape[-1])
    flat[1::2] = rounded_otherwise(flat[1::2])
    return y


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """Install a kernel double for this test, probed afresh (no remembered plans). The doubles replace the Python
    call of oneDNN's kernel, which the C++ stack of all layers does not make (it calls the kernel itself, by the same
    row plans: tests/models/test_decoder_fast_path.py checks its bits against the Python path's), so the layers take
    the Python path here."""
    monkeypatch.setenv("LLMPLUG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(NativeDecoderStack, "run", lambda *args: None)
    packed_linear.row_plan_for.cache_clear()
    yield lambda double: monkeypatch.setattr(packed_linear, "_packed_linear", double)
    packed_linear.row_plan_for.cache_clear()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(ParityRunner(tmp_path_factory.mktemp("row_plans")).checkpoint(CASE).path)


def engine(checkpoint: str, **kwargs) -> LLM:
    return LLM(checkpoint, **{**BASE_ENGINE_KWARGS, **CASE.engine_kwargs, "max_num_batched_tokens": 16, **kwargs})


def answers(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in outputs
    ]


PROMPTS = [[(7 * i + 3 * j) % 100 + 1 for j in range(5 + 3 * i)] for i in range(6)]


def test_a_row_count_dependent_kernel_is_padded_and_answers_do_not_depend_on_the_batch(kernel, checkpoint) -> None:
    kernel(otherwise_above(8))
    llm = engine(checkpoint)
    try:
        assert llm.llm_engine.config.model.batch_invariant is True
        methods = packed_linear.row_planned_methods(llm.llm_engine.engine_core.executor.worker.model_runner.model)
        assert methods and all(str(m.row_plan) == "at least 9 rows" for m in methods)
        alone = [answers(llm, [p])[0] for p in PROMPTS]
        assert answers(llm, PROMPTS) == alone
    finally:
        llm.shutdown()


def test_without_the_plan_the_double_changes_answers_with_the_batch(kernel, checkpoint, monkeypatch) -> None:
    """The twin: with the probe told every kernel is invariant, the same double makes answers batch dependent."""
    kernel(otherwise_above(8))
    monkeypatch.setattr(packed_linear, "find_row_plan", lambda *args, **kwargs: packed_linear.RowPlan())
    llm = engine(checkpoint)
    try:
        alone = [answers(llm, [p])[0] for p in PROMPTS]
        assert answers(llm, PROMPTS) != alone
    finally:
        llm.shutdown()


def test_auto_turns_the_mode_off_naming_the_weight_where_no_plan_holds(kernel, checkpoint, caplog) -> None:
    kernel(otherwise_at_odd_positions)
    with caplog.at_level(logging.WARNING, logger="llmplug.engine.batch_invariance"):
        llm = engine(checkpoint)
    try:
        assert llm.llm_engine.config.model.batch_invariant is False
        lines = [r.getMessage() for r in caplog.records if r.name == "llmplug.engine.batch_invariance"]
        assert len(lines) == 1 and "batch-invariant mode off" in lines[0] and "float32" in lines[0]
        assert re.search(r"\[\d+ x \d+\] float32 \(oneDNN packed\)", lines[0])  # names the weight and kernel
        assert answers(llm, PROMPTS[:1])[0][0]  # the engine still serves
    finally:
        llm.shutdown()


def test_true_is_refused_by_name_where_no_plan_holds(kernel, checkpoint, monkeypatch, tmp_path) -> None:
    kernel(otherwise_at_odd_positions)
    with pytest.raises(ConfigError, match=r"batch_invariant cannot hold.*\[\d+ x \d+\] float32"):
        engine(checkpoint, batch_invariant=True)
    kernel(REAL_KERNEL)  # the real kernel, probed afresh
    monkeypatch.setenv("LLMPLUG_CACHE_DIR", str(tmp_path / "fresh"))
    packed_linear.row_plan_for.cache_clear()
    llm = engine(checkpoint, batch_invariant=True)  # the next engine, on a kernel that holds, starts
    try:
        assert answers(llm, PROMPTS[:1])[0][0]
    finally:
        llm.shutdown()
