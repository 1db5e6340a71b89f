"""Intel GPUs through torch.xpu."""

from __future__ import annotations

import os

from llmplug.platforms.base import BasePlatform

__all__ = ["XpuPlatform"]


class XpuPlatform(BasePlatform):
    """Intel Data Center / Arc GPUs (a torch built with XPU support); collectives through XCCL."""

    name = "xpu"
    device_type = "xpu"
    priority = 80
    dispatch_key = "XPU"
    supported_dtypes = ("bfloat16", "float16", "float32")
    distributed_backend = "xccl"
    communicator = "xpu"
    default_attention_backend = "torch_sdpa"
    profiles_memory = True  # torch.xpu has the same peak-memory queries as torch.cuda

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """What was detected when torch has no usable XPU device."""
        import torch

        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return f"torch {torch.__version__} has no torch.xpu module (XPU needs torch >= 2.4)"
        # _is_compiled is private but the only way to tell "no XPU build" from "no device"
        if not getattr(xpu, "_is_compiled", lambda: True)():
            return f"torch {torch.__version__} was built without XPU support"
        if not xpu.is_available():
            mask = os.environ.get("ZE_AFFINITY_MASK", "<unset>")
            return (
                f"torch {torch.__version__} was built with XPU support but sees no Intel GPU (ZE_AFFINITY_MASK={mask})"
            )
        return None

    @classmethod
    def supports_dtype(cls, dtype: str) -> bool:
        """bf16 only where the GPU computes it natively."""
        if dtype == "bfloat16":
            import torch

            return torch.xpu.is_bf16_supported(including_emulation=False)
        return super().supports_dtype(dtype)
