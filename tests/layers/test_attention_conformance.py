"""The attention-backend conformance kit (llmplug.testing.attention): the in-tree backends pass it, and it catches
a backend that gets a feature wrong, claims a feature it refuses, or claims batch invariance it does not keep."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.attention.triton_backend import TritonAttentionBackend
from llmplug.testing.attention import SCENARIOS, check_attention_backend


def test_torch_sdpa_passes_every_scenario() -> None:
    """On llmplug's CPU kernels; tests/layers/test_attention_features.py runs the same steps on the torch paths too,
    with more windows, GQA ratios and feature combinations."""
    report = check_attention_backend(TorchSDPABackend)
    assert {name for name, *_ in report.passed} == {s.name for s in SCENARIOS}
    assert report.skipped == [] and report.batch_invariant is True


def test_torch_sdpa_passes_in_bfloat16() -> None:
    report = check_attention_backend(TorchSDPABackend, block_sizes=(4,), dtype=torch.bfloat16, atol=5e-2)
    assert len(report.passed) == 2 * len(SCENARIOS) - 1  # values_in_keys runs with one KV head only


def test_triton_passes_what_it_implements_and_refuses_the_rest() -> None:
    """Under triton's interpreter (tests/conftest.py): short requests, one block size."""
    combined = "window+softcap+alibi+sinks"
    report = check_attention_backend(TritonAttentionBackend, block_sizes=(4,), num_blocks=48,
                                     scenarios=["plain", combined, "chunked", "values_in_keys"])
    assert {name for name, *_ in report.passed} == {"plain", combined, "chunked"}
    assert report.skipped == ["values_in_keys"] and report.refused == ["values_in_keys"]
    assert report.batch_invariant is None


class IgnoresSoftcap(TorchSDPABackend):
    """Lists soft-capping but computes without it."""

    name = "ignores-softcap"

    @classmethod
    def forward(cls, layer, q, k, v, metadata):
        cap, layer.logit_softcap = layer.logit_softcap, None
        try:
            return super().forward(layer, q, k, v, metadata)
        finally:
            layer.logit_softcap = cap


class ListsNothing(TorchSDPABackend):
    """Plain attention only: every feature must be skipped by the kit and refused by bind_kv_cache."""

    name = "lists-nothing"
    supported_features = frozenset()


class RowsDependOnTheBatch(TorchSDPABackend):
    """Claims batch invariance but adds a term that depends on how many tokens the step has."""

    name = "batch-dependent"

    @classmethod
    def forward(cls, layer, q, k, v, metadata):
        out = super().forward(layer, q, k, v, metadata)
        return out + q.shape[0] * 1e-6


def test_a_backend_that_ignores_a_feature_it_lists_is_caught_by_name() -> None:
    with pytest.raises(AssertionError, match=r"'ignores-softcap', scenario 'logit_softcap'"):
        check_attention_backend(IgnoresSoftcap, block_sizes=(4,), scenarios=["plain", "logit_softcap"])


def test_a_backend_that_lists_nothing_runs_the_plain_scenario_and_is_refused_the_rest() -> None:
    report = check_attention_backend(ListsNothing, block_sizes=(4,))
    assert {name for name, *_ in report.passed} == {"plain"}
    assert set(report.refused) == {"sliding_window", "logit_softcap", "alibi", "sinks", "chunked", "values_in_keys"}


def test_a_backend_whose_rows_depend_on_the_batch_fails_its_invariance_claim() -> None:
    with pytest.raises(AssertionError, match="claims supports_batch_invariant"):
        check_attention_backend(RowsDependOnTheBatch, block_sizes=(4,), atol=1e-3, scenarios=["plain"])
