"""Every oneDNN kernel family this CPU has, not only its best one.

oneDNN picks its kernels by the best ISA the CPU has (AVX2, AVX-512, AVX-512 VNNI/BF16, AMX) unless
`ONEDNN_MAX_CPU_ISA` caps it, and each family sums in its own order. Users' CPUs are of every family, but one
test process sees only the best one here; so the guarantees that depend on the kernels (batch invariance of
the packed linear layers, the row plans, the int8 path: VNNI vs AMX-INT8) are run again in a subprocess
under each cap this CPU supports. A machine with AMX covers five families, an AVX-512 BF16 one four, an
AVX2-only one one (the subprocess then proves the cap is honoured end to end)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from llmplug.core.cpuinfo import ONEDNN_ISA_CAPS, cpu_flags, onednn_isa_caps
from llmplug.layers.kernels.native import MARCH_ENV

ROOT = Path(__file__).resolve().parents[2]
# what depends on the kernel family: the packed linear layers' row plans, the tiny families' invariance in
# bf16 / float32 / int8, the int8 matmul's exactness, the W4A8 matmul's bits; and, under AVX2 (the family
# furthest from AVX-512's and AMX's blockings; the uncapped suite runs the CPU's best), the default model's 32 chat
# prompts alone vs together (greedy: the seeded pair runs the same kernels)
TESTS = [
    "tests/layers/test_packed_linear.py",
    "tests/layers/test_int8_linear.py",
    "tests/layers/kernels/test_w4a8_matmul.py",  # the W4A8 kernel's vector paths: the same bits as its AMX one
    "tests/engine/test_batch_invariance_property.py::test_logits_and_tokens_do_not_depend_on_batch_chunks_prefix_hits_or_preemption",
]
DEFAULT_MODEL_PAIR = ("tests/engine/test_batch_invariance.py::"
                      "test_32_chat_prompts_alone_and_in_a_batch_of_32_are_identical[greedy]")
PROPERTY_FAMILIES = "LlamaForCausalLM or Qwen2MoeForCausalLM"  # dense and MoE experts; every family runs uncapped


@pytest.mark.slow
@pytest.mark.parametrize("cap", list(ONEDNN_ISA_CAPS))
def test_the_kernel_dependent_guarantees_hold_under_each_isa_cap(cap: str) -> None:
    supported = onednn_isa_caps()
    if cap not in supported:
        pytest.skip(f"this CPU lacks {sorted(ONEDNN_ISA_CAPS[cap] - cpu_flags())} for ONEDNN_MAX_CPU_ISA={cap}")
    best = supported[-1]
    tests = [*TESTS, DEFAULT_MODEL_PAIR] if cap == "AVX2" and cap != best else TESTS
    select = f"not LlamaForCausalLM-bfloat16-int4 and ({PROPERTY_FAMILIES} or not logits_and_tokens)"
    if cap == "AVX512_CORE_VNNI" and cap != best:  # adds int8 kernels only: its float32 ones are AVX512_CORE's
        tests, select = TESTS[1:], "int8"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": cap, "ONEDNN_VERBOSE": "0"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests, "-k", select]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, f"under ONEDNN_MAX_CPU_ISA={cap}:\n{tail}"
    assert " passed" in done.stdout and " failed" not in done.stdout, tail


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the generic x86-64 build")
def test_the_generic_build_of_llmplugs_cpu_kernels_passes_their_tests() -> None:
    """llmplug's C++ kernels are built per machine (`-march=native`): an AVX-512 machine runs their AVX-512 code,
    users without it the generic loops. Built for x86-64-v2 in a subprocess, the generic code passes the
    kernels' tests (against their torch references) here too."""
    env = {**os.environ, MARCH_ENV: "x86-64-v2"}
    # every test runs, none skipped, but the int4 kernel's AMX path's: the generic build has no AMX code
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
               "tests/layers/kernels/test_native_kernels.py", "tests/layers/kernels/test_paged_attention.py",
               "tests/layers/kernels/test_gguf_matmul.py", "tests/layers/kernels/test_fp8_matmul.py",
               "tests/layers/kernels/test_int4_matmul.py", "tests/layers/kernels/test_w4a8_matmul.py", "-k", "not amx"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " skipped" not in done.stdout.splitlines()[-1], tail
    probe = "from llmplug.layers.kernels.native import cflags, native_available; print(native_available(), cflags())"
    built = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert built.stdout.startswith("True") and "-march=x86-64-v2" in built.stdout, built.stderr[-2000:]
