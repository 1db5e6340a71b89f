"""What /proc/cpuinfo says about this machine's CPU: its model name and feature flags (no torch import)."""

from __future__ import annotations

import functools
import platform

__all__ = ["ONEDNN_ISA_CAPS", "cpu_flags", "cpu_model_name", "onednn_isa_caps"]


_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
# oneDNN's ISA caps (`ONEDNN_MAX_CPU_ISA` values), lowest first, with the CPU flags each one's kernels need:
# each names a kernel family that sums in its own order
ONEDNN_ISA_CAPS: dict[str, frozenset[str]] = {
    "AVX2": frozenset({"avx2"}),
    "AVX512_CORE": _AVX512,
    "AVX512_CORE_VNNI": _AVX512 | {"avx512_vnni"},
    "AVX512_CORE_BF16": _AVX512 | {"avx512_vnni", "avx512_bf16"},
    "AVX512_CORE_AMX": _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
}


@functools.lru_cache(maxsize=1)
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        with open("/proc/cpuinfo") as f:
            return tuple(f.read().splitlines())
    except OSError:
        return ()


def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo lists (x86 "flags", Arm "Features"); empty where it does not exist."""
    lines = _cpuinfo_lines()
    return frozenset(flag for line in lines if line.startswith(("flags", "Features")) for flag in line.split(":", 1)[1].split())


def cpu_model_name() -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) ..."); the platform module's answer without /proc."""
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine()


def onednn_isa_caps(flags: frozenset[str] | set[str] | None = None) -> list[str]:
    """The `ONEDNN_MAX_CPU_ISA` caps whose kernels a CPU with `flags` (default: this one's) runs, lowest first."""
    flags = cpu_flags() if flags is None else flags
    return [cap for cap, needed in ONEDNN_ISA_CAPS.items() if needed <= flags]
