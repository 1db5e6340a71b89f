"""Every pooling architecture embeds or classifies as transformers does, through the whole engine
(llmplug.testing pooling parity cases; several prompts per step, over several steps)."""

from __future__ import annotations

import time

import pytest

from llmplug.testing import PoolingParityCase, PoolingParityRunner

from .cases import POOLING_CASES


@pytest.fixture(scope="session")
def pooling_parity(tmp_path_factory: pytest.TempPathFactory) -> PoolingParityRunner:
    return PoolingParityRunner(tmp_path_factory.mktemp("pooling_parity"))


@pytest.mark.parametrize("case", POOLING_CASES, ids=lambda c: c.name)
def test_pooled_outputs_match_transformers(pooling_parity: PoolingParityRunner, case: PoolingParityCase) -> None:
    start = time.perf_counter()
    report = pooling_parity.check(case)
    print(f"{case.name} [{report.task}]: max |diff| {report.max_diff:.1e}, {time.perf_counter() - start:.2f} s")
