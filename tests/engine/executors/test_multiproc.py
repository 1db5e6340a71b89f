"""The multiproc executor: TP=2, PP=2 and TP=2 x PP=2 generate what one rank generates; worker calls;
a killed worker fails the engine fast and leaves no process behind."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest
import torch

from llmplug.core.config import load_config
from llmplug.core.errors import ConfigError, EngineDeadError
from llmplug.engine.llm_engine import LLMEngine
from tests.engine.executors.parity import (ENGINE_KWARGS, assert_matches, generate, make_llm, make_parallel_tiny,
                                           reference)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    return make_parallel_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def expected(tiny):
    return reference(tiny)


def new_children(before: set[int]) -> list[psutil.Process]:
    """Processes started by this one since `before`, except multiprocessing's resource tracker and the workers'
    forkserver (both live as long as this process, not an engine)."""
    return [
        child
        for child in psutil.Process().children(recursive=True)
        if child.pid not in before and not any(name in " ".join(child.cmdline())
                                               for name in ("resource_tracker", "forkserver"))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_greedy_output_equals_one_rank(tiny, expected, tp, pp):
    llm = make_llm(tiny, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert llm.config.parallel.executor == "multiproc"  # chosen for more than one worker
        assert_matches(generate(llm), expected)
    finally:
        llm.shutdown()


def rank_and_groups(worker) -> tuple[int, int, int]:
    """A function run in each worker: its global rank and its ranks in the TP and PP groups."""
    from llmplug.communicators.parallel_state import get_pp_group, get_tp_group

    return worker.rank, get_tp_group().rank_in_group, get_pp_group().rank_in_group


def weighted_sum(worker, tensor: torch.Tensor, *, weight: float) -> float:
    """A function with a tensor argument (3 MiB: more than a MessageQueue slot) and a keyword."""
    return float(tensor.sum()) * weight + worker.rank


def fail_on_rank_one(worker) -> None:
    if worker.rank == 1:
        raise KeyError("rank one refuses")


@pytest.mark.slow
def test_worker_calls_then_a_killed_worker_fails_fast_and_nothing_is_left(tmp_path):
    tiny = make_parallel_tiny("llama", tmp_path)
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    llm = make_llm(tiny, tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.executor
    pids = executor.worker_pids
    try:
        # arbitrary Worker methods and picklable functions, results in rank order
        assert executor.collective_rpc(rank_and_groups) == [(0, 0, 0), (1, 1, 0)]
        assert [info["vocab_size"] for info in executor.collective_rpc("model_info")] == [255, 255]
        ones = torch.ones(3 * 2**18)
        total = 2.0 * ones.numel()
        assert executor.collective_rpc(weighted_sum, (ones,), {"weight": 2.0}) == [total, total + 1]
        # an exception in a worker comes back as itself, with the worker's traceback as the cause
        with pytest.raises(KeyError, match="rank one refuses") as raised:
            executor.collective_rpc(fail_on_rank_one)
        assert "in worker rank 1" in str(raised.value.__cause__)
        assert executor.collective_rpc(rank_and_groups)[1] == (1, 1, 0)  # still serving

        # kill rank 1 at the third step of a generation
        steps, execute_model = [], executor.execute_model

        def execute_and_kill(scheduler_output):
            steps.append(time.monotonic())
            if len(steps) == 3:
                os.kill(pids[1], signal.SIGKILL)
            return execute_model(scheduler_output)

        executor.execute_model = execute_and_kill
        dead = r"worker rank 1 \(pid \d+\) exited unexpectedly \(killed by SIGKILL\)"
        with pytest.raises(EngineDeadError, match=dead):
            generate(llm)
        assert time.monotonic() - steps[2] < 5
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            executor.collective_rpc("model_info")  # the engine stays failed
    finally:
        llm.shutdown()
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert new_children(before) == []


def test_one_worker_runs_in_process_and_uniproc_refuses_several(tmp_path):
    tiny = make_parallel_tiny("llama", tmp_path)
    llm = make_llm(tiny)
    try:
        assert llm.config.parallel.executor == "uniproc"
    finally:
        llm.shutdown()
    with pytest.raises(ConfigError, match="'uniproc' runs one worker, but tensor_parallel_size=2"):
        make_llm(tiny, tensor_parallel_size=2, distributed_executor_backend="uniproc")
    # one LLMEngine is one replica (LLM starts data-parallel replicas itself: tests/engine/test_data_parallel.py)
    config = load_config(kwargs={"model": str(tiny.path), **ENGINE_KWARGS, "data_parallel_size": 2,
                                 "distributed_executor_backend": "multiproc"}).config
    with pytest.raises(ConfigError, match="data_parallel_size=2 with executor 'multiproc'"):
        LLMEngine(config)



def started_from(worker, name: str) -> tuple[bool, str | None]:
    """Whether this worker was forked from the preloaded forkserver, and the environment variable `name`."""
    return "llmplug.engine.executors.worker_preload" in sys.modules, os.environ.get(name)


@pytest.mark.slow
def test_workers_fork_from_the_forkserver_with_the_engine_environment_as_it_is_now(tmp_path, monkeypatch):
    # a forkserver's children start with the environment it had: a variable set since must reach them anyway
    tiny = make_parallel_tiny("llama", tmp_path)
    make_llm(tiny, tensor_parallel_size=2).shutdown()  # the forkserver exists from here on
    monkeypatch.setenv("LLMPLUG_TEST_SET_LATER", "later")
    llm = make_llm(tiny, tensor_parallel_size=2)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert executor.collective_rpc(started_from, ("LLMPLUG_TEST_SET_LATER",)) == [(True, "later")] * 2
        assert_matches(generate(llm), reference(tiny))
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_vllm_worker_multiproc_method_spawn_starts_fresh_interpreters(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    llm = make_llm(make_parallel_tiny("llama", tmp_path), tensor_parallel_size=2)
    try:
        executor = llm.llm_engine.engine_core.executor
        assert executor.collective_rpc(started_from, ("VLLM_WORKER_MULTIPROC_METHOD",)) == [(False, "spawn")] * 2
    finally:
        llm.shutdown()


def test_fork_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    with pytest.raises(ConfigError, match="VLLM_WORKER_MULTIPROC_METHOD='fork'.*forkserver or spawn"):
        make_llm(make_parallel_tiny("llama", tmp_path), tensor_parallel_size=2)
