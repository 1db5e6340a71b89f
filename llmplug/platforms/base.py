"""BasePlatform: the Platform protocol with defaults, plus the capability queries the engine asks.

Platform classes are used through their classmethods and never instantiated. Modules that define
them import no torch at module level, so listing and choosing platforms stays cheap; a method
imports torch when it needs it.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, ClassVar

from llmplug.core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from llmplug.core.config import EngineConfig

__all__ = ["BasePlatform"]


class BasePlatform:
    """Defaults shared by every platform; a platform overrides what its hardware does differently.

    The engine asks these classmethods about capabilities (dtype, device, memory, backends) and never
    compares platform names. Who calls what:
    - engine process, while resolving the config: `is_available`, `unavailable_reason`, `priority`,
      `check_and_update_config` (which uses `preferred_dtype`, `supports_dtype`, `get_attention_backend`);
    - each worker, at start-up: `visible_device_index`, `device`, `set_device`, `seed_everything`,
      memory queries (and, where `profiles_memory`, the peak-memory queries around a dummy step),
      `prepare_distributed` and `get_communicator` (several workers); during steps: `synchronize`, `empty_cache`.
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"
    priority: ClassVar[int] = 0
    dispatch_key: ClassVar[str] = "CPU"
    # in order of preference: the default preferred_dtype is the first one the device supports
    supported_dtypes: ClassVar[tuple[str, ...]] = ("float32",)
    distributed_backend: ClassVar[str] = "gloo"
    communicator: ClassVar[str] = "cpu"  # `llmplug.communicators` name for device groups
    ray_device_key: ClassVar[str] = "CPU"  # the Ray resource of one device (a worker's default bundle)
    default_attention_backend: ClassVar[str] = "torch_sdpa"  # `llmplug.attention` name
    # size the KV cache from a profiled dummy step (needs the peak-memory queries below), not from a budget rule
    profiles_memory: ClassVar[bool] = False
    # whether `model.batch_invariant` holds with this platform's kernels (docs/determinism.md); auto turns it on
    batch_invariant_kernels: ClassVar[bool] = False

    # --- detection (engine process; cheap, no side effects) -----------------------------------------

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this process cannot use the hardware (what was detected), or None when it can."""
        # reached when a platform overrides neither method, or only is_available() and it said False
        return f"{cls.__name__} reports its hardware unavailable and gives no reason (no unavailable_reason())"

    @classmethod
    def is_available(cls) -> bool:
        """True when this process can use the hardware."""
        return cls.unavailable_reason() is None

    # --- dtypes ----------------------------------------------------------------------------------------

    @classmethod
    def supports_dtype(cls, dtype: str) -> bool:
        """Whether the device computes in `dtype` ("float32", "bfloat16", "float16")."""
        return dtype in cls.supported_dtypes

    @classmethod
    def dtypes_here(cls) -> tuple[str, ...]:
        """The supported dtypes that this process's device actually has."""
        return tuple(dtype for dtype in cls.supported_dtypes if cls.supports_dtype(dtype))

    @classmethod
    def preferred_dtype(cls) -> str:
        """The dtype `model.dtype: auto` resolves to: the first supported dtype the device has."""
        return cls.dtypes_here()[0]

    # --- config (engine process, once, before workers start) ---------------------------------------------

    @classmethod
    def check_and_update_config(cls, config: EngineConfig) -> None:
        """Resolve `model.dtype: auto`, refuse a dtype the device lacks, fill `device.attention_backend`."""
        cls._resolve_dtype(config)
        device = config.device
        if device.attention_backend is None:
            # head_dim is unknown before the model's config is read; the model runner asks again with it
            device.attention_backend = cls.get_attention_backend(None, None, config.model.dtype)

    @classmethod
    def _resolve_dtype(cls, config: EngineConfig) -> None:
        """Set model.dtype to the preferred dtype when auto; raise ConfigError when unsupported."""
        model = config.model
        if model.dtype == "auto":
            model.dtype = cls.preferred_dtype()
        elif not cls.supports_dtype(model.dtype):
            here = cls.dtypes_here()
            raise ConfigError(
                f"model.dtype={model.dtype!r} is not supported by platform {cls.name!r} on this machine; "
                f"supported here: {', '.join(here)}. Set model.dtype to one of them or to 'auto' "
                f"(which picks {here[0]!r})."
            )

    @classmethod
    def get_attention_backend(cls, requested: str | None, head_dim: int | None, dtype: Any) -> str:
        """The `llmplug.attention` name to use: the requested one, else this platform's default."""
        return requested or cls.default_attention_backend

    @classmethod
    def prepare_distributed(cls) -> None:
        """Make `distributed_backend` known to torch.distributed (worker, before it joins the world).

        The built-in backends (gloo, nccl, xccl) need nothing; a platform whose backend comes from a
        library (torch_xla's "xla") imports the module that registers it here.
        """

    @classmethod
    def get_communicator(cls) -> str:
        """The `llmplug.communicators` name for device groups on this platform."""
        return cls.communicator

    # --- devices (worker) --------------------------------------------------------------------------------

    @classmethod
    def _device_module(cls) -> Any:
        """torch's module for this device type (torch.cuda, torch.xpu, torch.cpu)."""
        import torch

        return torch.get_device_module(cls.device_type)

    @classmethod
    def device_count(cls) -> int:
        """Number of devices this process sees."""
        return cls._device_module().device_count()

    @classmethod
    def visible_device_index(cls, local_rank: int) -> int:
        """Index, among the devices this process sees, of the one worker `local_rank` uses.

        A worker that sees one device (CUDA_VISIBLE_DEVICES set per process) uses index 0 whatever its
        local rank; one that sees them all uses its local rank.
        """
        count = cls.device_count()
        if count < 1:
            raise ConfigError(
                f"platform {cls.name!r} sees no device in this process (local rank {local_rank}); check the "
                f"visible-devices environment of the worker or set device.platform to another platform."
            )
        return local_rank % count

    @classmethod
    def device(cls, local_index: int) -> torch.device:
        """The torch device with index `local_index` among those this process sees."""
        import torch

        return torch.device(cls.device_type, local_index)

    @classmethod
    def set_device(cls, index: int) -> None:
        """Make device `index` the current one for this process (worker start-up)."""
        cls._device_module().set_device(index)

    @classmethod
    def empty_cache(cls) -> None:
        """Give cached, unused device memory back to the driver (after profiling, before sizing the KV cache)."""
        cls._device_module().empty_cache()

    @classmethod
    def synchronize(cls) -> None:
        """Wait until the device has finished all queued work (timings, profiling)."""
        cls._device_module().synchronize()

    # --- memory (worker) -----------------------------------------------------------------------------------

    @classmethod
    def total_memory(cls, device_id: int = 0) -> int:
        """Total memory of the device in bytes."""
        return int(cls._device_module().mem_get_info(device_id)[1])

    @classmethod
    def available_memory(cls, device_id: int = 0) -> int:
        """Free memory of the device in bytes."""
        return int(cls._device_module().mem_get_info(device_id)[0])

    @classmethod
    def memory_for_kv_cache(cls, memory_fraction: float, device_id: int = 0) -> int:
        """KV-cache bytes once the model is loaded: `memory_fraction` of total, less what is in use, at most free."""
        total = cls.total_memory(device_id)
        free = cls.available_memory(device_id)
        # the fraction bounds everything this device holds; what is already used (weights) comes out of it
        return max(0, min(free, int(total * memory_fraction) - (total - free)))

    @classmethod
    def memory_allocated(cls, device_id: int = 0) -> int:
        """Bytes torch's allocator holds in tensors on the device now (memory profiling)."""
        return int(cls._device_module().memory_allocated(device_id))

    @classmethod
    def reset_peak_memory_stats(cls, device_id: int = 0) -> None:
        """Start a new peak measurement (memory profiling)."""
        cls._device_module().reset_peak_memory_stats(device_id)

    @classmethod
    def peak_memory_allocated(cls, device_id: int = 0) -> int:
        """The most bytes held in tensors since the last `reset_peak_memory_stats` (memory profiling)."""
        return int(cls._device_module().max_memory_allocated(device_id))

    # --- randomness (worker) -------------------------------------------------------------------------------

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        """Seed python, numpy and torch RNGs (torch.manual_seed seeds every device type torch knows)."""
        import numpy as np
        import torch

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
