"""benchmarks/gpu_check.py, prepared for a GPU nobody here has, is proven runnable: its --cpu-smoke mode runs
every section (kernels against references, end-to-end greedy parity with transformers on the triton backend,
throughput) on the CPU under triton's interpreter and passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.slow
def test_cpu_smoke_runs_every_section_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--json", str(out)],
        capture_output=True, text=True, timeout=1200, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    checks = result["checks"]
    assert result["mode"] == "smoke" and all(c["ok"] for c in checks)
    sections = {c["section"] for c in checks}
    assert sections == {"kernels", "end to end", "throughput"}
    names = " ".join(c["name"] for c in checks)
    for kernel in ("paged_attention", "rms_norm", "silu_and_mul", "rotary", "reshape_and_cache", "bitmask"):
        assert kernel in names
    assert "default model (SmolLM2) greedy == transformers" in names and "tiny Qwen3 greedy" in names
