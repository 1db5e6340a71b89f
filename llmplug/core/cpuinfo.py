"""What /proc/cpuinfo says about this machine's CPU: its model name and feature flags (no torch import)."""

from __future__ import annotations

import functools
import platform

__all__ = ["cpu_flags", "cpu_model_name"]


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
