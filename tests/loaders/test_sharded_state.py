"""sharded_state: `llmplug save-sharded` writes per-rank files; the ranks of a TP=2 engine each open only
their own (counted with strace) and generate what one rank generates from the original checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from llmplug import LLM
from llmplug.core.errors import ConfigError, ModelLoadError
from llmplug.entrypoints.cli import main
from llmplug.loaders.sharded_state import save_sharded_state
from tests.engine.executors.parity import ENGINE_KWARGS, assert_matches, make_llm, make_parallel_tiny, reference

ROOT = Path(__file__).resolve().parents[2]
LOAD_AND_GENERATE = """
import json, sys
from llmplug import LLM
from tests.engine.executors.parity import ENGINE_KWARGS, generate
llm = LLM(sys.argv[1], **ENGINE_KWARGS, tensor_parallel_size=2)
print(json.dumps(generate(llm)))
llm.shutdown()
"""


def files_opened_per_process(trace: Path, pattern: str) -> dict[int, set[str]]:
    """pid -> names of the files matching `pattern` that it opened successfully, from `strace -ff -o trace`.

    One file per process (`trace.<pid>`): with a single shared file strace splits a call that another process
    interrupts into `<unfinished ...>` and `<... resumed>` lines, and such a split open would be missed.
    """
    opened: dict[int, set[str]] = defaultdict(set)
    for per_process in trace.parent.glob(f"{trace.name}.*"):
        pid = int(per_process.suffix[1:])
        for line in per_process.read_text().splitlines():
            match = re.match(r'^openat\([^,]+, "([^"]+)".*\) = \d+', line)
            if match and re.search(pattern, match.group(1)):
                opened[pid].add(os.path.basename(match.group(1)))
    return dict(opened)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="counting opened files needs strace")
def test_save_sharded_then_each_tp_rank_opens_only_its_own_files(tmp_path):
    tiny = make_parallel_tiny("qwen2", tmp_path / "model")
    expected = json.loads(json.dumps(reference(tiny)))  # as the subprocess prints it: token ids as strings
    out = tmp_path / "sharded"
    argv = ["save-sharded", str(tiny.path), str(out), "--tensor-parallel-size", "2", "--dtype", "float32",
            "--skip-tokenizer-init"]
    assert main(argv) == 0
    assert sorted(f.name for f in out.glob("model-rank-*")) == [
        "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"
    ]
    trace = tmp_path / "openat.trace"
    run = subprocess.run(
        # --seccomp-bpf: only openat stops the traced processes (without it every syscall of the engine and its
        # workers is stopped twice, to be filtered out afterwards); what is recorded is the same
        ["strace", "-ff", "--seccomp-bpf", "-e", "trace=openat", "-o", str(trace), sys.executable, "-c",
         LOAD_AND_GENERATE, str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert_matches(json.loads(run.stdout.strip().splitlines()[-1]), expected)
    opened = files_opened_per_process(trace, r"model-rank-\d+-part-\d+\.safetensors$")
    assert sorted(map(sorted, opened.values())) == [
        ["model-rank-0-part-0.safetensors"], ["model-rank-1-part-0.safetensors"]
    ]  # two processes (the workers), one file each, none the other's


def save_one_rank(tmp_path: Path) -> Path:
    """The tiny Llama saved as sharded state by a one-rank engine."""
    tiny = make_parallel_tiny("llama", tmp_path / "model")
    out = tmp_path / "sharded"
    llm = make_llm(tiny)
    try:
        llm.llm_engine.engine_core.executor.collective_rpc(save_sharded_state, (str(out),))
    finally:
        llm.shutdown()
    return out


def test_a_tensor_parallel_size_other_than_the_saved_one_is_a_clear_error(tmp_path):
    out = save_one_rank(tmp_path)
    reloaded = LLM(str(out), **ENGINE_KWARGS)  # load.format auto finds the layout file
    reloaded.shutdown()
    assert reloaded.config.load.format == "sharded_state"
    (out / "sharded_state.json").write_text(json.dumps({"tensor_parallel_size": 2, "pipeline_parallel_size": 1}))
    with pytest.raises(ConfigError, match=r"sharded for \{'tensor_parallel_size': 2.*this engine runs"):
        LLM(str(out), **ENGINE_KWARGS)


@pytest.mark.parametrize("damage", ["truncate", "corrupt"])
def test_a_damaged_rank_file_is_a_clear_error_naming_it(tmp_path, damage):
    out = save_one_rank(tmp_path)
    (rank_file,) = out.glob("model-rank-*.safetensors")
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    with pytest.raises(ModelLoadError, match=re.escape(rank_file.name)):
        LLM(str(out), **ENGINE_KWARGS)
