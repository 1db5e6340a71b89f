"""Google TPUs through torch_xla (PJRT runtime), device type "xla"."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from llmplug.core.errors import ConfigError
from llmplug.platforms.base import BasePlatform

__all__ = ["TpuPlatform"]


def _xm() -> Any:
    """torch_xla.core.xla_model, imported on first use."""
    import torch_xla.core.xla_model as xm

    return xm


class TpuPlatform(BasePlatform):
    """TPU chips attached to this host; below CUDA in `auto`, since torch_xla can also drive GPUs."""

    name = "tpu"
    device_type = "xla"
    priority = 90
    dispatch_key = "XLA"
    supported_dtypes = ("bfloat16", "float32")  # TPUs have no fast float16
    distributed_backend = "xla"
    communicator = "tpu"
    default_attention_backend = "torch_sdpa"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """What was detected when there is no TPU: torch_xla missing, failing, or driving another device."""
        if importlib.util.find_spec("torch_xla") is None:
            return "torch_xla is not installed (pip install torch_xla[tpu] on a TPU host)"
        try:
            import torch_xla.runtime as xr

            kind = xr.device_type()
        except (ImportError, RuntimeError) as error:
            return f"torch_xla is installed but failed to start: {type(error).__name__}: {error}"
        if kind != "TPU":
            pjrt = os.environ.get("PJRT_DEVICE", "<unset>")
            return f"torch_xla's runtime device is {kind!r}, not 'TPU' (PJRT_DEVICE={pjrt})"
        return None

    @classmethod
    def prepare_distributed(cls) -> None:
        """Register torch_xla's "xla" process-group backend with torch.distributed (importing it does)."""
        try:
            import torch_xla.distributed.xla_backend  # noqa: F401
        except ImportError as error:
            raise ConfigError(
                f"device.platform 'tpu' with several workers needs torch_xla's 'xla' distributed backend, which "
                f"failed to import ({error}); install torch_xla[tpu] on the TPU host"
            ) from error

    @classmethod
    def device_count(cls) -> int:
        """TPU devices this process can address."""
        import torch_xla.runtime as xr

        return xr.addressable_device_count()

    @classmethod
    def set_device(cls, index: int) -> None:
        """PJRT binds each process to its devices when it starts; nothing to select."""

    @classmethod
    def empty_cache(cls) -> None:
        """XLA owns device memory; there is no allocator cache to release."""

    @classmethod
    def synchronize(cls) -> None:
        """Wait for every pending XLA computation."""
        _xm().wait_device_ops()

    @classmethod
    def _memory_info(cls, device_id: int) -> tuple[int, int]:
        """(free, total) bytes of TPU device `device_id` from torch_xla's memory info."""
        info = _xm().get_memory_info(cls.device(device_id))
        if "bytes_limit" in info:  # newer torch_xla; older ones report kb_free / kb_total
            return info["bytes_limit"] - info["bytes_used"], info["bytes_limit"]
        return info["kb_free"] * 1024, info["kb_total"] * 1024

    @classmethod
    def total_memory(cls, device_id: int = 0) -> int:
        """HBM of the TPU device in bytes."""
        return int(cls._memory_info(device_id)[1])

    @classmethod
    def available_memory(cls, device_id: int = 0) -> int:
        """Free HBM of the TPU device in bytes."""
        return int(cls._memory_info(device_id)[0])

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        """Seed python, numpy, torch and the XLA device's RNG."""
        super().seed_everything(seed)
        _xm().set_rng_state(seed)
