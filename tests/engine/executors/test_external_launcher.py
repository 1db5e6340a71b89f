"""The external launcher: torchrun starts the ranks, each runs a whole engine, and every rank's greedy
output equals one rank's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmplug.core.errors import ConfigError
from llmplug.engine.executors.base import free_local_port
from tests.engine.executors.parity import assert_matches, make_llm, make_parallel_tiny, reference

ROOT = Path(__file__).resolve().parents[3]


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc` of the rank script, rendezvous on 127.0.0.1, one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_local_port()}",
        str(ROOT / "tests/engine/executors/external_launcher_rank.py"), *args,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2"])
def test_torchrun_ranks_with_tp2_generate_what_one_rank_generates(name, tmp_path):
    tiny = make_parallel_tiny(name, tmp_path / "model")
    expected = reference(tiny)
    run = torchrun(2, str(tiny.path), str(tmp_path), "2", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    expected = json.loads(json.dumps(expected))  # as the ranks wrote theirs: token ids as strings
    for rank in range(2):
        assert_matches(json.loads((tmp_path / f"rank{rank}.json").read_text()), expected)


def test_external_launcher_without_rank_variables_says_what_is_missing(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    tiny = make_parallel_tiny("llama", tmp_path)
    with pytest.raises(ConfigError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.*torchrun"):
        make_llm(tiny, distributed_executor_backend="external_launcher")
