"""What /proc/cpuinfo says about this machine's CPU: its model name, feature flags and whether bf16 is native here
(no torch import unless /proc/cpuinfo cannot answer)."""

from __future__ import annotations

import functools
import os
import platform

__all__ = ["ONEDNN_ISA_CAPS", "cpu_flags", "cpu_model_name", "has_native_bf16", "onednn_isa_caps"]


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
# CPU flags of native bf16 arithmetic: x86 AVX512-BF16 / AMX-BF16, Arm's BF16 extension
_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
# oneDNN ISA caps under which its kernels may use the CPU's bf16 instructions
_BF16_ISA_CAPS = frozenset({
    "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT",
})


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


def _torch_cpu_flags() -> set[str]:
    """The CPU capabilities torch detected (torch.cpu.get_capabilities, recent torch only), as a set of names."""
    import torch

    get_capabilities = getattr(torch.cpu, "get_capabilities", None)
    if get_capabilities is None:
        return set()
    return {name for name, present in get_capabilities().items() if present is True}


def has_native_bf16() -> bool:
    """Whether bf16 is computed in hardware here (else it is emulated and slower than float32): the CPU has the
    instructions and oneDNN's ISA cap (`ONEDNN_MAX_CPU_ISA`, if set) lets its kernels use them."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    if cap and cap.upper() not in _BF16_ISA_CAPS:
        return False
    # /proc/cpuinfo first: it answers on Linux without importing torch
    return bool(_NATIVE_BF16_FLAGS & cpu_flags()) or bool(_NATIVE_BF16_FLAGS & _torch_cpu_flags())
