"""`llmplug collect-env`: the CPU, its flags, the oneDNN ISA (under a cap), versions, threads and the kernel table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmplug.core.cpuinfo import ONEDNN_ISA_CAPS, cpu_flags, onednn_isa_caps
from llmplug.entrypoints.collect_env import NOT_ONEDNN, format_report
from tests.plugin_examples import pip_install_examples, run_python

FLAGS = cpu_flags()
CAPS = onednn_isa_caps(FLAGS)
# the default model's linear layers as llmplug fuses them (SmolLM2-135M: hidden 576, 9 + 2 x 3 heads of 64)
DEFAULT_MODEL_SHAPES = {"qkv_proj": [960, 576], "o_proj": [576, 576], "gate_up_proj": [3072, 576],
                        "down_proj": [576, 1536], "lm_head": [49152, 576]}


@pytest.fixture(scope="module")
def capped_report() -> dict:
    """`llmplug collect-env --json` in a fresh process, under the lowest ISA cap this CPU supports (if any)."""
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA=CAPS[0]) if CAPS else dict(os.environ)
    result = subprocess.run([Path(sys.executable).with_name("llmplug"), "collect-env", "--json"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_caps_follow_the_cpuinfo_flags():
    avx512 = {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    zen4 = avx512 | {"avx512_vnni", "avx512_bf16"}
    assert onednn_isa_caps(zen4) == ["AVX2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16"]
    assert onednn_isa_caps(zen4 | {"amx_tile", "amx_bf16", "amx_int8"})[-1] == "AVX512_CORE_AMX"
    assert onednn_isa_caps({"avx2"}) == ["AVX2"]
    assert onednn_isa_caps(set()) == []
    assert list(ONEDNN_ISA_CAPS)[0] == "AVX2" and list(ONEDNN_ISA_CAPS)[-1] == "AVX512_CORE_AMX"


@pytest.mark.slow  # one `llmplug collect-env` (~15 CPU-seconds: the row-plan probes of 5 shapes)
def test_it_names_the_cpu_its_flags_and_versions(capped_report):
    report = capped_report
    assert report["cpu"]
    assert set(report["cpu_flags"]) <= FLAGS
    assert ("avx2" in report["cpu_flags"]) == ("avx2" in FLAGS)
    assert report["onednn_isa_caps"] == CAPS
    assert report["torch"] == torch.__version__
    assert re.fullmatch(r"v\d+\.\d+(\.\d+)?", report["onednn"])
    assert report["torch_threads"] >= 1 and report["usable_cpus"] >= 1
    assert report["preferred_dtype"] in ("bfloat16", "float32")
    assert {"gptq", "awq", "fp8"} <= {method.split(" ")[0] for method in report["quantization_methods"]}


@pytest.mark.slow
@pytest.mark.skipif(not CAPS, reason="no oneDNN ISA cap applies to this CPU")
def test_the_onednn_isa_in_use_is_the_capped_one(capped_report):
    # oneDNN's info line names the ISA as words ("Intel AVX2", "Intel AVX-512 with ... bfloat16 support")
    assert capped_report["ONEDNN_MAX_CPU_ISA"] == CAPS[0]
    assert capped_report["onednn_isa"] and "AVX" in capped_report["onednn_isa"]
    if CAPS[0] == "AVX2":
        assert "AVX-512" not in capped_report["onednn_isa"] and "AMX" not in capped_report["onednn_isa"]


@pytest.mark.slow  # one `llmplug collect-env` (~15 CPU-seconds: the row-plan probes of 5 shapes)
def test_every_linear_shape_of_the_default_model_names_its_kernel(capped_report):
    kernels = {row["layer"]: row for row in capped_report["kernels"]}
    assert {name: row["shape"] for name, row in kernels.items()} == DEFAULT_MODEL_SHAPES
    for row in kernels.values():
        assert row["kernel_1_rows"] and row["kernel_8_rows"] and row["kernel_256_rows"]
        kernel = "oneDNN packed" if row["packed"] else "torch F.linear"  # the probe chose how to call it
        assert re.fullmatch(rf"{kernel}: (none|any rows|at least \d+ rows|tiles of \d+ rows)", row["row_plan"])
        if row["packed"]:  # a packed shape runs a oneDNN kernel
            assert NOT_ONEDNN not in (row["kernel_1_rows"], row["kernel_8_rows"], row["kernel_256_rows"])
            if CAPS and CAPS[0] == "AVX2":  # the report ran capped at AVX2: no AVX-512 or AMX kernel, whatever the CPU
                kernels = " ".join(row[f"kernel_{n}_rows"] for n in (1, 8, 256))
                assert "avx512" not in kernels and "amx" not in kernels


@pytest.mark.slow  # one `llmplug collect-env` (~15 CPU-seconds: the row-plan probes of 5 shapes)
def test_the_text_report_has_one_line_per_field_and_a_kernel_table(capped_report):
    text = format_report(capped_report)
    assert f"cpu: {capped_report['cpu']}" in text.splitlines()
    assert f"onednn: {capped_report['onednn']}" in text.splitlines()
    table = text.split("default model")[1].splitlines()
    assert table[1].split()[:3] == ["layer", "shape", "packed"]
    assert table[2].split()[:2] == ["qkv_proj", "960x576"]


def test_it_lists_the_installed_quantization_methods_in_tree_and_third_party(tmp_path):
    site = tmp_path / "site"
    pip_install_examples(["toy_quantization"], site, tmp_path / "sources")
    result = run_python(
        """
        import json
        from llmplug.entrypoints.collect_env import format_report, quantization_methods
        methods = quantization_methods()
        text = format_report({"quantization_methods": methods, "kernels": [], "kernel_dtype": "float32"})
        print(json.dumps({"methods": methods, "text": text}))
        """,
        site,
    )
    methods = result["methods"]
    assert "toy-int8 (llmplug-example-toy-quantization)" in methods
    in_tree = {method.split(" ")[0] for method in methods if "(" not in method.split(" [")[0]}
    assert {"gptq", "awq", "compressed-tensors", "fp8"} <= in_tree
    assert f"quantization_methods: {', '.join(methods)}" in result["text"].splitlines()
