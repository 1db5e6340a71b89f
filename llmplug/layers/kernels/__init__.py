"""Triton kernels of the hot ops, each beside a plain-torch reference (`reference.py`).

Exports `triton_available`, `use_triton` and `require_triton_device`; the kernels themselves live in
one module each (`paged_attention`, `reshape_and_cache`, `rms_norm`, `rotary`, `activation`,
`bitmask`, `moe_align`), imported only where they run, because importing them imports triton.

Where the kernels run: on the tensors of a GPU that triton compiles for (device type "cuda", which
is NVIDIA and ROCm alike), or on any device under triton's interpreter (`TRITON_INTERPRET=1`, read
by triton when a kernel module is first imported), which is how the tests check them on a CPU.
The layers (RMSNorm, SiluAndMul, rotary, the sampler's bitmask, the MoE experts' grouping) take the
kernel path for a tensor when `use_triton(tensor)` says so; the `triton` attention backend always
uses its kernels.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["TRITON_DEVICE_TYPES", "interpreting", "require_triton_device", "triton_available", "use_triton"]

TRITON_DEVICE_TYPES = ("cuda",)  # torch device types whose tensors compiled triton kernels run on
KERNELS_ENV = "LLMPLUG_TRITON_KERNELS"  # "auto" (default), "0": layers never use triton, "1": always


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed in this environment."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter (numpy on the host) rather than compiling them."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(x: torch.Tensor) -> bool:
    """Whether the layers compute on `x` with their Triton kernel rather than with torch.

    Auto: when triton is installed and x lives on a GPU it compiles for. LLMPLUG_TRITON_KERNELS=0
    keeps the torch path everywhere; =1 takes the kernel path on any device (the CPU needs
    TRITON_INTERPRET=1, and runs it slowly: for tests).
    """
    mode = os.environ.get(KERNELS_ENV, "auto")
    if mode == "0" or not triton_available():
        return False
    return mode == "1" or x.is_cuda  # TRITON_DEVICE_TYPES: `is_cuda` is the cheap test of x.device.type == "cuda"


def require_triton_device(x: torch.Tensor, what: str) -> None:
    """Raise a clear error when a kernel cannot run on x's device (a CPU tensor outside the interpreter)."""
    if x.device.type in TRITON_DEVICE_TYPES or interpreting():
        return
    raise RuntimeError(
        f"{what} is a Triton kernel and cannot run on {x.device.type!r} tensors: run it on a CUDA/ROCm GPU, "
        "or set TRITON_INTERPRET=1 before llmplug imports its kernels to run them (slowly) in triton's interpreter"
    )
