"""Deciding `model.batch_invariant` once, in the engine process, before any worker starts (docs/determinism.md)."""

from __future__ import annotations

import logging

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginRegistry

logger = logging.getLogger(__name__)


def resolve_batch_invariant(config: EngineConfig, platform: type, registry: PluginRegistry) -> None:
    """Turn `model.batch_invariant: auto` into True or False; refuse True where it cannot hold.

    auto is on where the platform's kernels and the attention backend implement the mode and nothing in
    the config asks for a kernel chosen per batch (int4 copies, the compiled forward) or runs without a
    KV cache (pooling). `config.device.attention_backend` must already be resolved by the platform.
    """
    model = config.model
    backend = registry.load("llmplug.attention", config.device.attention_backend or "torch_sdpa")
    backend_invariant = getattr(backend, "supports_batch_invariant", False)
    if model.batch_invariant == "auto":
        blockers = {
            f"platform {platform.name!r}": not getattr(platform, "batch_invariant_kernels", False),
            f"attention backend {backend.name!r}": not backend_invariant,
            f"quantization={model.quantization!r}": model.quantization != "none",
            "device.compile": config.device.compile,
            "runner 'pooling'": model.runner == "pooling",
        }
        off = [name for name, blocks in blockers.items() if blocks]
        model.batch_invariant = not off
        if off:
            logger.info("batch-invariant mode off (auto): not with %s", ", ".join(off))
        return
    if model.batch_invariant and not backend_invariant:
        raise ConfigError(
            f"model.batch_invariant needs an attention backend that reduces in a fixed order; "
            f"device.attention_backend={backend.name!r} does not: use 'torch_sdpa' or turn "
            "batch_invariant off (--no-batch-invariant)"
        )
    if model.batch_invariant and model.quantization == "int4":
        raise ConfigError(
            "model.batch_invariant cannot be combined with quantization='int4': the int4 kernel is chosen per "
            "call by the step's token count, so outputs would depend on the batch; use quantization='none'"
        )
