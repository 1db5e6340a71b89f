"""`llmplug run` (`make run`): the README's first answer on every kernel family this CPU has.

The demo's default model answers "What is the capital of France?" with a 0.08-nat near-tie at its first token,
which bf16 rounding tipped into a degenerate loop on an AMX CPU (issue 34); the demo computes in float32 so that
it holds on every CPU. oneDNN honours `ONEDNN_MAX_CPU_ISA`, so one machine runs the demo on each float32 kernel
family it has: AVX2 and AVX-512 (the VNNI, BF16 and AMX caps add int8 and bf16 kernels, not float32 ones; those
families are covered in bf16 by tests/engine/test_isa_caps.py).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmplug.core.cpuinfo import cpu_flags, onednn_isa_caps
from llmplug.entrypoints.engine_args import add_engine_args
from llmplug.entrypoints.generate import DEMO_DTYPE, _demo_config

README = Path(__file__).resolve().parents[2] / "README.md"
CAPITAL = "What is the capital of France?"


def _readme_answer(question: str) -> str:
    """The first line of the README's shown answer to `question` ("What `make run` prints")."""
    shown = README.read_text().split("## What `make run` prints", 1)[1].split("```")[1]
    return re.search(rf"Q: {re.escape(question)}\nA: (.*)", shown).group(1)


def _demo(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(flags))


def test_the_demo_computes_the_default_model_in_float32_unless_told_otherwise(tmp_path):
    assert _demo_config(_demo()).model.dtype == DEMO_DTYPE == "float32"
    assert _demo_config(_demo("--dtype", "bfloat16")).model.dtype == "bfloat16"
    file = tmp_path / "engine.yaml"
    file.write_text("model:\n  dtype: bfloat16\n")
    assert _demo_config(_demo("--config", str(file))).model.dtype == "bfloat16"
    assert _demo_config(_demo("--model", str(tmp_path))).model.dtype == "auto"  # another model: its own default


def test_the_readme_shows_paris():
    assert "Paris" in _readme_answer(CAPITAL)


# The CPU's best kernels, and AVX2's float32 kernels where the best are AVX-512 ones
_SUPPORTED = onednn_isa_caps(cpu_flags())
CAPS = [None] + (["AVX2"] if len(_SUPPORTED) > 1 and "AVX2" in _SUPPORTED else [])


@pytest.mark.slow  # one `llmplug run` per cap: ~10-20 CPU-seconds each (start-up, row-plan probes, 16 tokens)
@pytest.mark.parametrize("cap", CAPS)
def test_make_run_answers_the_capital_question_as_the_readme_shows(cap):
    env = dict(os.environ, **({"ONEDNN_MAX_CPU_ISA": cap} if cap else {}))
    # 16 tokens hold the capital answer; a small KV cache keeps the process small (the default takes 4 GiB)
    command = [Path(sys.executable).with_name("llmplug"), "run", "--max-tokens", "16",
               "--kv-cache-memory", str(64 << 20), "--max-model-len", "1024"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    answer = re.search(rf"Q: {re.escape(CAPITAL)}\nA: (.*)", result.stdout).group(1)
    assert answer == _readme_answer(CAPITAL), f"under ONEDNN_MAX_CPU_ISA={cap}:\n{result.stdout}"
    assert "Paris" in answer
