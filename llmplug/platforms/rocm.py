"""AMD GPUs through a ROCm (HIP) build of torch, which exposes them as torch.cuda devices."""

from __future__ import annotations

import os

from llmplug.platforms.cuda import CudaApiPlatform

__all__ = ["RocmPlatform"]


class RocmPlatform(CudaApiPlatform):
    """AMD Instinct/Radeon GPUs: device type "cuda", RCCL behind the "nccl" backend name."""

    name = "rocm"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """What was detected when torch has no usable ROCm device."""
        import torch

        if torch.version.hip is None:
            return f"torch {torch.__version__} was built without ROCm (HIP)"
        if not torch.cuda.is_available():
            names = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
            visible = {name: os.environ[name] for name in names if name in os.environ}
            return (
                f"torch {torch.__version__} was built with HIP {torch.version.hip} but sees no usable AMD GPU "
                f"({visible or 'no *_VISIBLE_DEVICES set'}; check the driver with rocm-smi)"
            )
        return None
