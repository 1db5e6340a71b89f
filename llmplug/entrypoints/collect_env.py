"""`llmplug collect-env` (vLLM's name): what a bug report or a benchmark table must say about the machine.

Machines of one kind come with different CPUs (AMD Zen without AMX, Intel Xeon with AMX), and oneDNN picks
its kernels, and so the rounding of every bf16 result, by the CPU it finds (docs/determinism.md). This prints
the CPU and its flags, the oneDNN ISA in use (after any `ONEDNN_MAX_CPU_ISA` cap), the threads, torch's and
oneDNN's versions, which oneDNN kernel each packed linear shape of the default model gets here, at one
row and at more, with the row plan the batch-invariant mode probed for it (layers/row_invariance.py), and the
quantization methods installed (the `llmplug.quantization` plugins a quantized checkpoint can be run with).

Kept light at import time (the CLI builds every parser on each call): torch loads inside `run`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from llmplug.core.cpuinfo import cpu_flags, cpu_model_name, onednn_isa_caps

# The flags a kernel choice depends on, as /proc/cpuinfo names them (x86, then Arm).
REPORTED_FLAGS = (
    "avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni", "avx512_bf16",
    "avx512_fp16", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "asimd", "bf16", "i8mm", "sve", "sve2",
)
# Row counts the kernel table probes: a lone decode row, a small batch, a prefill-sized one.
PROBED_ROWS = (1, 8, 256)
NOT_ONEDNN = "not oneDNN (MKL or ATen)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--json: one JSON object instead of text; --dtype: the dtype of the kernel table."""
    parser.add_argument("--json", action="store_true", help="One JSON object instead of text.")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                        help="dtype of the kernel table; auto: what the CPU platform prefers here. Default: auto.")


def run(args: argparse.Namespace) -> int:
    """Print the machine's report."""
    from llmplug import _configure_threads_before_torch

    _configure_threads_before_torch()  # the engine's thread settings, before torch loads
    report = collect(args.dtype)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


# --- what the CPU says ---------------------------------------------------------------------------


# --- what torch and oneDNN say -------------------------------------------------------------------


def onednn_version() -> str | None:
    """oneDNN's version as torch's build config names it (`Intel(R) MKL-DNN v3.x`), or None."""
    import torch

    match = re.search(r"(?:oneDNN|MKL-DNN) (v[\d.]+)", torch.__config__.show())
    return match.group(1) if match else None


def onednn_verbose(work: Callable[[], Any]) -> list[str]:
    """oneDNN's verbose lines (written to fd 1 by C code) while `work` runs."""
    import ctypes

    import torch

    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile(mode="w+") as sink:
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                work()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return [line for line in sink.read().splitlines() if line.startswith("onednn_verbose")]


def _isa_of(lines: list[str]) -> str | None:
    """The `isa:` of oneDNN's info line (printed once, before the process's first verbose primitive)."""
    return next((line.split("isa:", 1)[1].strip() for line in lines if ",isa:" in line), None)


def _implementation_of(lines: list[str]) -> str | None:
    """The implementation name of the last executed primitive (`brg_matmul:avx512_core_amx`, `x64:gemm:jit`)."""
    executed = [line.split(",") for line in lines if ",exec," in line]
    if not executed:
        return None
    parts = executed[-1]
    return parts[parts.index("exec") + 3]


# --- which kernel each packed shape gets ---------------------------------------------------------


def default_model_shapes() -> dict[str, tuple[int, int]]:
    """[out, in] of each linear weight of the default model, as llmplug fuses them (qkv, gate_up)."""
    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path
    from llmplug.loaders.gguf import load_gguf_config

    config = load_gguf_config(resolve_model_path(DEFAULT_MODEL))
    hidden, head_dim = config.hidden_size, getattr(config, "head_dim", None)
    head_dim = head_dim or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {
        "qkv_proj": (q + 2 * kv, hidden),
        "o_proj": (hidden, q),
        "gate_up_proj": (2 * config.intermediate_size, hidden),
        "down_proj": (hidden, config.intermediate_size),
        "lm_head": (config.vocab_size, hidden),
    }


def kernel_rows(shapes: dict[str, tuple[int, int]], dtype: Any) -> list[dict[str, Any]]:
    """Per shape: packed or not, the oneDNN implementation at each of PROBED_ROWS, and the row plan under which
    the batch-invariant mode calls it (`packed_linear.row_plan_for`, probed here or remembered from an engine
    start on this machine; "none" where no plan holds and the mode cannot hold for the shape)."""
    import torch

    from llmplug.layers.packed_linear import _packed_linear, prepack_supported, row_plan_for

    packed_here = prepack_supported("cpu", dtype)
    rows = []
    for name, (out_features, in_features) in shapes.items():
        weight = torch.randn(out_features, in_features).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight) if packed_here else None
        row: dict[str, Any] = {"layer": name, "shape": [out_features, in_features], "packed": packed_here}
        for num_rows in PROBED_ROWS:
            x = torch.randn(num_rows, in_features).to(dtype)
            call = (lambda: _packed_linear(x, packed, None)) if packed_here else (lambda: torch.nn.functional.linear(x, weight))
            row[f"kernel_{num_rows}_rows"] = _implementation_of(onednn_verbose(call)) or NOT_ONEDNN
        kernel = "oneDNN packed" if packed_here else "torch F.linear"
        plan = row_plan_for(kernel, out_features, in_features, dtype, torch.get_num_threads())
        row["row_plan"] = f"{kernel}: {plan or 'none'}"
        rows.append(row)
    return rows


# --- which quantized checkpoints run here -----------------------------------------------------------


def quantization_methods() -> list[str]:
    """Each installed `llmplug.quantization` method: its name, its distribution when not llmplug's, and why it cannot
    be used here when it cannot (plugin metadata and the file system only, as `llmplug plugins`)."""
    from llmplug.core.plugins import get_registry

    methods = []
    for row in get_registry().describe():
        if row["group"] != "llmplug.quantization":
            continue
        name = row["name"] if row["distribution"] == "llmplug" else f"{row['name']} ({row['distribution']})"
        methods.append(name if row["usable"] else f"{name} [not usable: {row['reason']}]")
    return methods


# --- the report ----------------------------------------------------------------------------------


def collect(dtype_name: str = "auto") -> dict[str, Any]:
    """Everything `llmplug collect-env` prints, as one dict."""
    import torch

    from llmplug import __version__
    from llmplug.platforms.cpu import CpuPlatform

    model, flags = cpu_model_name(), cpu_flags()
    dtype_name = CpuPlatform.preferred_dtype() if dtype_name == "auto" else dtype_name
    isa_lines = onednn_verbose(lambda: torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 8)))
    report: dict[str, Any] = {
        "llmplug": __version__, "python": platform.python_version(), "os": platform.platform(),
        "cpu": model, "cpu_flags": [flag for flag in REPORTED_FLAGS if flag in flags],
        "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
        "onednn_isa_caps": onednn_isa_caps(flags),
        "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        "torch": torch.__version__, "onednn": onednn_version(), "mkldnn_available": torch.backends.mkldnn.is_available(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "preferred_dtype": CpuPlatform.preferred_dtype(), "kernel_dtype": dtype_name,
    }
    report["quantization_methods"] = quantization_methods()
    report["kernels"] = kernel_rows(default_model_shapes(), getattr(torch, dtype_name))
    # the info line comes with the process's first verbose output, wherever that was
    report["onednn_isa"] = _isa_of(isa_lines)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as `key: value` lines, then the kernel table."""
    lines = [f"{key}: {(', '.join(value) or 'none') if key == 'quantization_methods' else _shown(value)}"
             for key, value in report.items() if key != "kernels"]
    lines += ["", f"oneDNN kernel of each linear layer of the default model ({report['kernel_dtype']}):"]
    columns = ["layer", "shape", "packed"] + [f"kernel_{n}_rows" for n in PROBED_ROWS] + ["row_plan"]
    cells = [columns] + [[_shown(row[c]) for c in columns] for row in report["kernels"]]
    widths = [max(len(cell[i]) for cell in cells) for i in range(len(columns))]
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(cell, widths)).rstrip() for cell in cells]
    lines.append("row_plan: how the batch-invariant mode calls the kernel so that a row's bits do not depend on "
                 "how many rows share the call (docs/determinism.md); none: no plan holds here.")
    return "\n".join(lines)


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) if not value or not isinstance(value[0], int) else "x".join(map(str, value))
    return "-" if value is None else str(value)
