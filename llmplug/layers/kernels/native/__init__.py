"""llmplug's CPU kernels (`ops.cpp`): RMSNorm with its residual add, SiLU-and-mul, rotary, the KV write, paged
attention, and the matmul of GGUF-quantized weights from their raw blocks (llmplug.quantization.gguf); (`fp8.cpp`)
the matmul of fp8 weights with their scales (llmplug.quantization.fp8); (`int4.cpp`) the matmul of weight-only int4
groups (llmplug.layers.kernels.int4_matmul); (`amx_linear.cpp`) the bf16 and int8 (W8A8) matmuls on Intel AMX
tiles, the bf16 one also through SiLU-and-mul or a qkv's rotary (llmplug.layers.kernels.amx_linear);
(`decoder_stack.cpp`)
`torch.classes.llmplug_cpu.DecoderStack`, a model's plain int4 layers run as one call a step
(llmplug.layers.decoder.native_stack).

Eager PyTorch runs each of these as 5–40 small ops, each a Python-level dispatch of a few microseconds,
which at one decode token is most of their cost (docs/benchmarks.md). Here each is one call, with every
output row computed by one thread in one fixed order: batch invariant by construction (docs/determinism.md).

The sources are compiled once with the host's compiler (`torch.utils.cpp_extension`, about a minute, for this
CPU: `-march=native`, or `$LLMPLUG_CPU_MARCH`) into one library, in a directory named by a hash of every source,
the flags, torch's version and the CPU, under `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`); every
later process loads the library from there in milliseconds. `make setup` builds it
(`python -m llmplug.layers.kernels.native`), else the first forward pass does. Where it cannot be built (no C++
compiler), the layers keep their torch paths and the log says why, once.

`use_native(x)` is the layers' switch: the kernels run on CPU tensors, eager or compiled (in a torch.compile graph
each is one opaque call, so the compiled forward computes eager's bits). LLMPLUG_CPU_KERNELS=0 keeps the torch
paths everywhere.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

__all__ = ["KERNELS_ENV", "MARCH_ENV", "cflags", "native_available", "ops", "use_native"]

logger = logging.getLogger(__name__)

KERNELS_ENV = "LLMPLUG_CPU_KERNELS"  # "auto" (default): on CPU tensors when the kernels build; "0": never
NAME = "llmplug_cpu_ops"
SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "ops.cpp", "prompt_attention.cpp", "fp8.cpp", "int4.cpp", "w4a8.cpp", "amx_linear.cpp", "decoder_stack.cpp"
))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # included by the sources: part of the build's key
MARCH_ENV = "LLMPLUG_CPU_MARCH"  # the target CPU of the build: "native" (default) or a generic one, e.g. x86-64-v2


def cflags() -> list[str]:
    """The compiler's flags: for this CPU (`-march=native`), or for `$LLMPLUG_CPU_MARCH` (the tests build the
    generic code paths too, which CPUs without AVX-512 run)."""
    return ["-O3", f"-march={os.environ.get(MARCH_ENV) or 'native'}", "-fopenmp", "-fno-math-errno", "-std=c++20"]


LDFLAGS = ["-fopenmp", "-lmvec"]  # libmvec: glibc's vectorized expf


def build_directory() -> Path:
    """Where the kernels are built: one directory per set of sources (and headers), flags, torch version and CPU
    (`-march=native`)."""
    from torch.utils.cpp_extension import get_default_build_root

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    flags = next((line for line in lines if line.startswith("flags")), "")
    sources = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = "\n".join([*sources, *cflags(), *LDFLAGS, torch.__version__, platform.machine(), flags])
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # as torch's own extensions
    return Path(root) / f"{NAME}_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@torch.compiler.assume_constant_result  # torch.compile calls it and takes the answer (no tracing into the build)
def native_available() -> bool:
    """Whether the kernels are loaded, building them on the first call of the first process (later processes load
    the built library directly: no compiler, no lock); False, logged, if they cannot be built."""
    return _load()


@functools.cache
def _load() -> bool:
    directory = build_directory()
    library = directory / f"{NAME}.so"
    try:
        if library.exists():
            torch.ops.load_library(str(library))
            _register_fakes()
            return True
        from torch.utils.cpp_extension import load

        logger.info("building llmplug's CPU kernels in %s (once, about a minute)", directory)
        directory.mkdir(parents=True, exist_ok=True)
        # fresh lists: torch appends its own flags to the lists it is given, which would change build_directory()'s key
        load(NAME, [str(source) for source in SOURCES], extra_cflags=cflags(), extra_ldflags=list(LDFLAGS),
             build_directory=str(directory), is_python_module=False)
    except (ImportError, OSError, RuntimeError) as exc:  # no compiler, no ninja, a failed build: torch paths serve
        logger.warning("llmplug's CPU kernels could not be built (%s); the layers use their torch paths", exc)
        return False
    _register_fakes()
    return True


@functools.cache
def _register_fakes() -> None:
    """The kernels' output shapes for torch.compile's tracing (the kernels stay opaque calls in a compiled graph)."""
    fakes = {
        "rms_norm": lambda x, weight, eps: torch.empty_like(x),
        "fused_add_rms_norm": lambda x, residual, weight, eps: torch.empty_like(x),
        "silu_and_mul": lambda x: x.new_empty(x.shape[0], x.shape[1] // 2),
        "rotary_embedding": lambda x, cos, sin, neox: None,
        "reshape_and_cache": lambda k, v, key_cache, value_cache, slot_mapping: None,
        "paged_attention": lambda q, key_cache, value_cache, *rest: q.new_empty(
            q.shape[0], q.shape[1] * value_cache.shape[-1]
        ),
        "cache_and_attend": lambda q, k, v, kv_cache, *rest: q.new_empty(q.shape),
        "greedy": lambda logits: (
            logits.new_empty(logits.shape[0], dtype=torch.int64),
            logits.new_empty(logits.shape[0]),
        ),
        "row_bmm": lambda a, b: a.new_empty(a.shape[0], a.shape[1], b.shape[2]),
        "gguf_matmul": lambda x, w, type_id, tables: x.new_empty(x.shape[0], w.shape[0]),
        "fp8_matmul": lambda x, w, scale: x.new_empty(x.shape[0], w.shape[0]),
        "int4_matmul": lambda x, qweight, scales, zeros, group_size: x.new_empty(x.shape[0], qweight.shape[0]),
        "w4a8_matmul": lambda x, packed, out_features: x.new_empty(x.shape[0], out_features),
        "amx_linear": lambda x, packed, bias, out_features: x.new_empty(x.shape[0], out_features),
        "amx_linear_silu_and_mul": lambda x, packed, bias, out_features: x.new_empty(x.shape[0], out_features // 2),
        "amx_linear_rotary": lambda x, packed, bias, out_features, *rotary: x.new_empty(x.shape[0], out_features),
        "amx_int8_linear": lambda x, packed, scale, bias, out_features: x.new_empty(x.shape[0], out_features),
        "gguf_get_rows": lambda w, ids, type_id, tables, out: None,
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"llmplug_cpu::{name}", fake)


def ops() -> torch._ops._OpNamespace:
    """The kernels, `torch.ops.llmplug_cpu` (built first if need be)."""
    if not native_available():
        raise RuntimeError("llmplug's CPU kernels are not available (see the log for why)")
    return torch.ops.llmplug_cpu


def use_native(x: torch.Tensor) -> bool:
    """Whether the layers compute on `x` with these kernels: a CPU tensor, the kernels built, LLMPLUG_CPU_KERNELS
    not "0". Under torch.compile too: each kernel is one opaque call in the graph, so a compiled forward computes
    what the eager one does, bit for bit."""
    if not x.is_cpu or os.environ.get(KERNELS_ENV, "auto") == "0":
        return False
    return native_available()
