"""NVIDIA GPUs through torch.cuda, and the base shared with ROCm (which torch also drives as "cuda")."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from llmplug.platforms.base import BasePlatform

logger = logging.getLogger(__name__)

__all__ = ["CudaApiPlatform", "CudaPlatform"]


class CudaApiPlatform(BasePlatform):
    """What NVIDIA CUDA and AMD ROCm share: torch drives both as device type "cuda" with NCCL/RCCL."""

    device_type = "cuda"
    priority = 100
    dispatch_key = "CUDA"
    supported_dtypes = ("bfloat16", "float16", "float32")
    distributed_backend = "nccl"  # RCCL on ROCm answers to the same backend name
    communicator = "cuda"
    ray_device_key = "GPU"
    default_attention_backend = "triton"
    profiles_memory = True

    @classmethod
    def get_attention_backend(cls, requested: str | None, head_dim: int | None, dtype: Any) -> str:
        """The requested backend, else `triton`; `torch_sdpa` when triton is not installed (said in the log)."""
        if requested:
            return requested
        if importlib.util.find_spec("triton") is None:
            logger.warning("triton is not installed: attention runs on the torch_sdpa backend (pip install triton)")
            return "torch_sdpa"
        return cls.default_attention_backend

    @classmethod
    def supports_dtype(cls, dtype: str) -> bool:
        """bf16 only where the GPU computes it natively; float16 and float32 everywhere."""
        if dtype == "bfloat16":
            import torch

            return torch.cuda.is_bf16_supported(including_emulation=False)
        return super().supports_dtype(dtype)


class CudaPlatform(CudaApiPlatform):
    """NVIDIA GPUs (a torch built with CUDA, not ROCm)."""

    name = "cuda"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """What was detected when torch has no usable CUDA device."""
        import torch

        if torch.version.hip is not None:
            return f"torch {torch.__version__} is a ROCm (HIP {torch.version.hip}) build; use device.platform 'rocm'"
        if torch.version.cuda is None:
            return f"torch {torch.__version__} was built without CUDA"
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
            return (
                f"torch {torch.__version__} was built with CUDA {torch.version.cuda} but sees no usable NVIDIA GPU "
                f"(CUDA_VISIBLE_DEVICES={visible}; check the driver with nvidia-smi)"
            )
        return None

    @classmethod
    def supports_dtype(cls, dtype: str) -> bool:
        """bf16 needs compute capability 8.0 (Ampere) or newer."""
        if dtype == "bfloat16":
            import torch

            return torch.cuda.get_device_capability() >= (8, 0)
        return super().supports_dtype(dtype)
