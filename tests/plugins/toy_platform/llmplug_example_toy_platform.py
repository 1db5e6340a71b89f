"""Example platform plugin: 'toy', a stand-alone Platform that runs on the CPU.

It implements llmplug.core.protocols.Platform without subclassing anything in-tree, so it shows the
whole contract. Its priority is far below any real platform's, so `device.platform: auto` never picks
it; select it by name (`device: {platform: toy}`).
"""

from __future__ import annotations

import os
import random
from typing import Any

LLMPLUG_PLUGIN_API_VERSION = "1.0"


class ToyPlatform:
    """A CPU-backed platform that exists to show how a third-party platform plugs in."""

    name = "toy"
    device_type = "cpu"
    priority = -1000  # below every real platform: never chosen by `auto`
    dispatch_key = "CPU"
    supported_dtypes = ("float32",)
    distributed_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        """Always: it needs nothing but a CPU."""
        return True

    @classmethod
    def check_and_update_config(cls, config: Any) -> None:
        """Force float32, the only dtype the toy supports."""
        if config.model.dtype == "auto":
            config.model.dtype = "float32"

    @classmethod
    def get_attention_backend(cls, requested: str | None, head_dim: int, dtype: Any) -> str:
        """The requested backend, or the torch reference one."""
        return requested or "torch_sdpa"

    @classmethod
    def get_communicator(cls) -> str:
        """CPU process groups."""
        return "cpu"

    @classmethod
    def total_memory(cls, device_id: int = 0) -> int:
        """Physical memory in bytes."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    @classmethod
    def available_memory(cls, device_id: int = 0) -> int:
        """Free physical memory in bytes."""
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        """Seed python's, numpy's and torch's RNGs (torch imported only here: listing stays cheap)."""
        import numpy
        import torch

        random.seed(seed)
        numpy.random.seed(seed)
        torch.manual_seed(seed)

    @classmethod
    def device_count(cls) -> int:
        """One CPU 'device'."""
        return 1
