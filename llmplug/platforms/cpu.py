"""The CPU platform: always available, the fallback of `device.platform: auto`."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from llmplug.core.cpuinfo import has_native_bf16
from llmplug.core.errors import ConfigError
from llmplug.platforms.base import BasePlatform
from llmplug.platforms.cpu_threads import threads_per_process

if TYPE_CHECKING:
    import torch

    from llmplug.core.config import EngineConfig

__all__ = ["CpuPlatform"]

logger = logging.getLogger(__name__)

_UNLIMITED_CGROUP_MEMORY = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes, keyed by field name; empty where the file does not exist."""
    try:
        with open("/proc/meminfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    fields = (line.split() for line in lines)
    return {
        parts[0].rstrip(":"): int(parts[1]) * (1024 if parts[-1] == "kB" else 1) for parts in fields if len(parts) >= 2
    }


def _cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's cgroup (v2 or v1), or None when unlimited."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as f_limit, open(usage_file) as f_usage:
                limit, usage = f_limit.read().strip(), int(f_usage.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= _UNLIMITED_CGROUP_MEMORY:
            return None
        return int(limit), usage
    return None


def _sysconf_bytes(pages_name: str) -> int:
    """`pages_name` pages times the page size, for systems without /proc/meminfo."""
    try:
        return os.sysconf(pages_name) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError) as error:
        raise ConfigError(
            f"cannot read the machine's memory on this OS (no /proc/meminfo, sysconf {pages_name}: {error}); "
            f"set cache.kv_cache_memory or cache.num_blocks."
        ) from error


# vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE=4): at most this much KV cache when nothing sizes it
DEFAULT_KV_CACHE_BYTES = 4 * 2**30


def default_kv_cache_memory(available: int) -> int:
    """The CPU's default KV-cache budget: a quarter of the `available` bytes, at most DEFAULT_KV_CACHE_BYTES; logged
    with the bound that held. The worker turns it into no more blocks than the engine can use."""
    quarter, mib = available // 4, 2**-20
    budget = min(DEFAULT_KV_CACHE_BYTES, quarter)
    if quarter < DEFAULT_KV_CACHE_BYTES:
        bound = f"a quarter of the {available * mib:.0f} MiB free (at most {DEFAULT_KV_CACHE_BYTES * mib:.0f} MiB)"
    else:
        bound = f"the CPU default (a quarter of the {available * mib:.0f} MiB free is more)"
    logger.info("KV-cache budget: %.0f MiB, %s; set cache.kv_cache_memory or cache.num_blocks to choose",
                budget * mib, bound)
    return budget


class CpuPlatform(BasePlatform):
    """Runs on the host CPU with torch's CPU kernels; memory is the machine's RAM (or the cgroup's limit)."""

    name = "cpu"
    device_type = "cpu"
    priority = 0
    dispatch_key = "CPU"
    supported_dtypes = ("float32", "bfloat16", "float16")
    distributed_backend = "gloo"
    communicator = "cpu"
    default_attention_backend = "torch_sdpa"
    batch_invariant_kernels = True  # oneDNN's packed linear layers and fixed-order attention (docs/determinism.md)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """The CPU is always there."""
        return None

    @classmethod
    def preferred_dtype(cls) -> str:
        """bfloat16 where the CPU has native bf16 (AVX512-BF16, AMX, Arm BF16), else float32."""
        return "bfloat16" if has_native_bf16() else "float32"

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Base checks, the default `device.num_threads` (the CPUs split among the engine's workers) and
        a default KV-cache budget: the model shares host memory with everything else, so the cache takes
        a quarter of what is free, at most `DEFAULT_KV_CACHE_BYTES`, rather than a fraction of all RAM
        (`memory_fraction` is not used on the CPU); the worker allocates no more blocks than
        max_num_seqs requests of max_model_len tokens can use."""
        super().check_and_update_config(config)
        if config.device.num_threads is None:
            config.device.num_threads = threads_per_process(cls.num_cpu_processes(config))
        cache = config.cache
        if cache.num_blocks is None and cache.kv_cache_memory is None:
            cache.kv_cache_memory = default_kv_cache_memory(cls.available_memory())

    @staticmethod
    def num_cpu_processes(config: EngineConfig) -> int:
        """Worker processes of this engine that share the machine's cores."""
        parallel = config.parallel
        return parallel.tensor_parallel_size * parallel.pipeline_parallel_size * parallel.data_parallel_size

    @classmethod
    def device_count(cls) -> int:
        """One CPU device: every worker uses it."""
        return 1

    @classmethod
    def device(cls, local_index: int) -> torch.device:
        """torch.device("cpu"): tensors on the CPU carry no index, so neither does the device."""
        import torch

        return torch.device("cpu")

    @classmethod
    def set_device(cls, index: int) -> None:
        """Nothing to select on the CPU."""

    @classmethod
    def empty_cache(cls) -> None:
        """The CPU allocator returns freed memory itself; nothing is cached."""

    @classmethod
    def synchronize(cls) -> None:
        """CPU kernels run synchronously; nothing to wait for."""

    @classmethod
    def total_memory(cls, device_id: int = 0) -> int:
        """RAM in bytes (MemTotal), capped by the cgroup memory limit of a container."""
        total = _meminfo().get("MemTotal") or _sysconf_bytes("SC_PHYS_PAGES")
        cgroup = _cgroup_memory()
        return min(total, cgroup[0]) if cgroup else total

    @classmethod
    def available_memory(cls, device_id: int = 0) -> int:
        """RAM that can be allocated without swapping (MemAvailable), capped by the cgroup's headroom."""
        free = _meminfo().get("MemAvailable") or _sysconf_bytes("SC_AVPHYS_PAGES")
        cgroup = _cgroup_memory()
        return min(free, max(0, cgroup[0] - cgroup[1])) if cgroup else free
