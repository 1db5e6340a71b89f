"""CPU threading: how many OpenMP/MKL threads each process runs and how idle threads wait.

OpenMP reads OMP_NUM_THREADS and OMP_WAIT_POLICY once, when torch's OpenMP runtime loads (at
`import torch`), so `configure_cpu_threads` must run before torch is first imported in a process.
After that only the thread count can still change (torch.set_num_threads).

Policy (measurements in docs/platforms.md, "CPU threading"):
- one process owning the cores: threads = cores, OMP_WAIT_POLICY=ACTIVE, so threads spin between
  parallel regions instead of sleeping and being woken for every matmul; GOMP_SPINCOUNT bounds that
  spinning to some tens of milliseconds (libgomp's ACTIVE default is 30 billion spins: an idle engine,
  e.g. a server between requests, would keep a core busy forever and slow everything else on it);
- several processes sharing the cores (multiproc workers), or more threads than cores: threads =
  cores // processes, OMP_WAIT_POLICY=PASSIVE, because a spinning thread holds a core that a thread
  of another team needs; a team that waits on a descheduled member stalls a whole timeslice (8-30 ms
  per matmul measured, instead of ~0.4 ms).

A variable the user set in the environment is never overridden. Variables llmplug set are recorded in
LLMPLUG_CPU_THREADS_OWNED, so a later call (a worker process inheriting the engine's environment) may
replace them with its own values.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Any

__all__ = ["available_cpu_count", "threads_per_process", "configure_cpu_threads"]

logger = logging.getLogger(__name__)

OWNED_ENV = "LLMPLUG_CPU_THREADS_OWNED"  # comma-separated names of the variables llmplug set
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_POLICY_VAR = "OMP_WAIT_POLICY"
_SPIN_VAR = "GOMP_SPINCOUNT"
# ~1e6 spins is 20-40 ms here: far longer than the gaps between a step's ops, short enough that an idle
# process sleeps almost at once (idle CPU 45% -> ~1%, docs/platforms.md)
ACTIVE_SPIN_COUNT = 1_000_000
# Intel's OpenMP (KMP_*) derives its blocktime from OMP_WAIT_POLICY (ACTIVE: infinite, PASSIVE: 0), and
# torch's Linux wheels ship GNU libgomp, which ignores KMP_BLOCKTIME; so KMP_BLOCKTIME is left alone.


def _cgroup_cpu_limit() -> int | None:
    """Whole CPUs the cgroup quota allows (v2 cpu.max, v1 cfs quota), or None when unlimited."""
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            with open(path) as f:
                fields = f.read().split()
        except OSError:
            continue
        if path.endswith("cpu.max"):
            quota, period = fields[0], fields[1] if len(fields) > 1 else "100000"
        else:
            quota, period = fields[0], _read_first("/sys/fs/cgroup/cpu/cpu.cfs_period_us") or "100000"
        if quota in ("max", "-1"):
            return None
        # floor: a team of ceil(quota) threads would be throttled every period
        return max(1, math.floor(int(quota) / int(period)))
    return None


def _read_first(path: str) -> str | None:
    """The first whitespace-separated field of a small file, or None when it cannot be read."""
    try:
        with open(path) as f:
            return f.read().split()[0]
    except (OSError, IndexError):
        return None


def available_cpu_count() -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup CPU quota."""
    if hasattr(os, "sched_getaffinity"):
        count = len(os.sched_getaffinity(0))
    else:  # macOS, Windows: no affinity API
        count = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    return min(count, limit) if limit else count


def threads_per_process(num_processes_sharing: int = 1) -> int:
    """Threads each of `num_processes_sharing` processes gets when they split the CPUs evenly (at least 1)."""
    return max(1, available_cpu_count() // max(1, num_processes_sharing))


def _wait_policy(num_threads: int, num_processes_sharing: int, cores: int) -> str:
    """ACTIVE for one process that fits its cores; PASSIVE when cores are shared or oversubscribed."""
    return "ACTIVE" if num_processes_sharing <= 1 and num_threads <= cores else "PASSIVE"


def _owned() -> set[str]:
    """The variables an earlier call (in this or a parent process) set, as opposed to the user."""
    return {name for name in os.environ.get(OWNED_ENV, "").split(",") if name}


def _user_value(name: str) -> str | None:
    """The value the user set for `name`, or None when unset or set by llmplug."""
    return None if name in _owned() else os.environ.get(name)


def _user_thread_count() -> int | None:
    """OMP_NUM_THREADS as the user set it (first entry of a nested list), or None."""
    value = _user_value("OMP_NUM_THREADS")
    if value is None:
        return None
    try:
        return max(1, int(value.split(",")[0]))
    except ValueError:
        logger.warning("OMP_NUM_THREADS=%r is not a number; OpenMP will ignore it. Set it to a thread count.", value)
        return None


def _apply(wanted: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Set each wanted variable the user did not set; return the values in effect and the user-kept names."""
    owned, kept = _owned(), []
    for name, value in wanted.items():
        if _user_value(name) is not None:
            kept.append(name)
            continue
        os.environ[name] = value
        owned.add(name)
    os.environ[OWNED_ENV] = ",".join(sorted(owned))
    return {name: os.environ[name] for name in wanted}, kept


def _apply_to_loaded_torch(num_threads: int, policy_changed: bool) -> None:
    """Torch is already imported: set its thread count; the wait policy can no longer change."""
    import torch

    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    if policy_changed:
        logger.warning(
            "torch was imported before configure_cpu_threads(), so OMP_WAIT_POLICY=%s cannot take effect in "
            "this process (OpenMP read the environment at import); call configure_cpu_threads() before the "
            "first `import torch`, or export OMP_WAIT_POLICY before starting Python.",
            os.environ.get(_POLICY_VAR),
        )


def configure_cpu_threads(num_threads: int | None = None, num_processes_sharing: int = 1) -> dict[str, Any]:
    """Set OpenMP/MKL threads and wait policy for this process; call before torch is first imported.

    num_threads: threads for this process (device.num_threads); None: the available CPUs divided among
    `num_processes_sharing` processes. User-set OMP_NUM_THREADS / MKL_NUM_THREADS / OMP_WAIT_POLICY win.
    Returns what is in effect: num_threads, wait_policy, cpus, env, user_set, torch_was_imported.
    """
    cores = available_cpu_count()
    threads = _user_thread_count() or num_threads or threads_per_process(num_processes_sharing)
    policy = _wait_policy(threads, num_processes_sharing, cores)
    torch_was_imported = "torch" in sys.modules
    policy_before = os.environ.get(_POLICY_VAR)
    wanted = {name: str(threads) for name in _THREAD_VARS} | {_POLICY_VAR: policy}
    if policy == "ACTIVE":
        wanted[_SPIN_VAR] = str(ACTIVE_SPIN_COUNT)
    env, user_set = _apply(wanted)
    if torch_was_imported:
        _apply_to_loaded_torch(threads, policy_changed=env[_POLICY_VAR] != policy_before)
    return {
        "num_threads": threads,
        "wait_policy": env[_POLICY_VAR],
        "cpus": cores,
        "num_processes_sharing": num_processes_sharing,
        "env": env,
        "user_set": user_set,
        "torch_was_imported": torch_was_imported,
    }
