"""Deciding `model.batch_invariant` once, in the engine process, before any worker starts (docs/determinism.md)."""

from __future__ import annotations

import logging

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginRegistry

logger = logging.getLogger(__name__)


def resolve_batch_invariant(config: EngineConfig, platform: type, registry: PluginRegistry) -> None:
    """Turn `model.batch_invariant: auto` into True or False; refuse True where it cannot hold.

    auto is on where the platform's kernels, the attention backend and the model implement the mode and nothing
    in the config asks for a kernel chosen per batch (the compiled forward, quantization=int4's quantized prompts)
    or runs without a KV cache (pooling). int8 weights (an exact integer matmul, per-token activation scales) keep
    it, and so do quantization=auto's int4 copies: an int4 layer then computes the generated tokens with its int4
    copy and the prompts densely, a kernel chosen by a token's position, never by its batch (both kernels probed row
    invariant per shape; a layer that fails stays dense). quantization=int4 holds the mode when asked for (True):
    every token count in int4. `config.device.attention_backend` must already be resolved by the platform.
    """
    model = config.model
    backend = registry.load("llmplug.attention", config.device.attention_backend or "torch_sdpa")
    backend_invariant = getattr(backend, "supports_batch_invariant", False)
    model_gap = _model_gap(config, registry)
    if model.batch_invariant == "auto":
        blockers = {
            f"platform {platform.name!r}": not getattr(platform, "batch_invariant_kernels", False),
            f"attention backend {backend.name!r}": not backend_invariant,
            f"quantization={model.quantization!r} (int4 at every size only when asked: batch_invariant=true)":
                model.quantization == "int4",
            "device.compile": config.device.compile,
            "runner 'pooling'": model.runner == "pooling",
            f"this model ({model_gap})": model_gap is not None,
        }
        off = [name for name, blocks in blockers.items() if blocks]
        model.batch_invariant = not off
        model._invariance_asked = False
        if off:
            logger.info("batch-invariant mode off (auto): not with %s", ", ".join(off))
        return
    if not model.batch_invariant:
        return
    model._invariance_asked = True
    if not backend_invariant:
        raise ConfigError(
            f"model.batch_invariant needs an attention backend that reduces in a fixed order; "
            f"device.attention_backend={backend.name!r} does not: use 'torch_sdpa' or turn "
            "batch_invariant off (--no-batch-invariant)"
        )
    if model_gap is not None and model.runner != "pooling":
        raise ConfigError(f"model.batch_invariant cannot hold for {model.model}: {model_gap}; turn it off "
                          "(--no-batch-invariant)")


def _model_gap(config: EngineConfig, registry: PluginRegistry) -> str | None:
    """Why the model cannot be batch invariant (its class's `batch_invariance_gap`), or None where it can."""
    from llmplug.loaders import build_loader

    loader = build_loader(registry, config.load.format, config.load)
    hf_config = loader.load_hf_config(config.model)
    model_class = loader.get_model_class(hf_config, config.model.model_impl)
    gap = getattr(model_class, "batch_invariance_gap", None)
    if gap is None:
        return f"{model_class.__name__} does not declare batch_invariance_gap"
    return gap(hf_config)


def settle_row_invariance(config: EngineConfig, row_variant: list[str]) -> None:
    """After the workers set up their weights: where some weight found no row plan on this CPU (its kernel sums
    rows in an order that depends on their number, and neither padding nor fixed tiles fix it;
    layers/row_invariance.py), the mode cannot hold. `auto` turns it off with one log line naming the weights
    and the kernel; an explicit `true` is refused by name."""
    model = config.model
    if not model.batch_invariant_on or not row_variant:
        return
    why = (f"on this CPU the linear kernel of {', '.join(row_variant)} sums a row in an order that depends on the "
           "number of rows, and no row plan (padding, fixed row tiles) makes it invariant")
    if model._invariance_asked:
        raise ConfigError(f"model.batch_invariant cannot hold for {model.model}: {why}; turn it off "
                          "(--no-batch-invariant), or cap oneDNN's ISA (ONEDNN_MAX_CPU_ISA) to a kernel family "
                          "that holds it (docs/determinism.md)")
    model.batch_invariant = False
    logger.warning("batch-invariant mode off (auto): %s", why)
