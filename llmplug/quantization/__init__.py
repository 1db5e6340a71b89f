"""Quantized checkpoints: the `llmplug.quantization` plugin group, its protocol and the choice of a method.

See `llmplug.quantization.base` for the protocol a method implements; `resolve_quantization` picks the
checkpoint's method (or refuses, naming what is wrong and what is installed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llmplug.core.config.schema import QUANTIZATION_MODES
from llmplug.core.errors import ConfigError
from llmplug.quantization.base import QuantizationConfig, QuantizedExpertsMethod, QuantizedLinearMethod
from llmplug.quantization.context import building_with, checkpoint_method_for

if TYPE_CHECKING:
    from llmplug.core.config import ModelConfig
    from llmplug.core.plugins import PluginRegistry

__all__ = [
    "GROUP",
    "RUNTIME_MODES",
    "QuantizationConfig",
    "QuantizedExpertsMethod",
    "QuantizedLinearMethod",
    "building_with",
    "checkpoint_method_for",
    "checkpoint_quant_method",
    "resolve_quantization",
]

GROUP = "llmplug.quantization"
# what `quantization` means for dense and GGUF checkpoints: llmplug's own int4/int8 copies (layers/quantization.py)
RUNTIME_MODES = QUANTIZATION_MODES
# formats another loader reads whole (load.format bitsandbytes): not a method of this group
_LOADER_FORMATS = ("bitsandbytes",)


def checkpoint_quant_method(hf_config: Any) -> tuple[str, dict[str, Any]] | None:
    """(quant_method, quantization_config) of a checkpoint's config, or None when it is not quantized."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict() if hasattr(quantization, "to_dict") else vars(quantization)
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if not isinstance(method, str) or not method:
        raise ConfigError(f"the checkpoint's quantization_config has no quant_method: {quantization}")
    return method.lower(), quantization


def resolve_quantization(
    hf_config: Any, model_config: ModelConfig, registry: PluginRegistry
) -> QuantizationConfig | None:
    """The method the model's linear layers are built with: the checkpoint's own (its config.json says which),
    None for a dense checkpoint. ConfigError when the checkpoint's method is not installed, when `quantization`
    names another method, or names one for a checkpoint that is not quantized."""
    asked = model_config.quantization
    found = checkpoint_quant_method(hf_config)
    installed = registry.names(GROUP)
    if found is None or found[0] in _LOADER_FORMATS:
        if asked not in RUNTIME_MODES:
            raise ConfigError(
                f"quantization={asked!r} asks for a quantized checkpoint's method, but "
                f"{model_config.model} has no quantization_config in its config.json; for a dense checkpoint use "
                f"one of {', '.join(RUNTIME_MODES)}"
                + ("" if asked in installed else f" (and {asked!r} is not an installed method: {_listing(installed)})")
            )
        return None
    method, settings = found
    if method not in installed:
        raise ConfigError(
            f"{model_config.model} is quantized with {method!r}, which no installed {GROUP} plugin implements; "
            f"installed: {_listing(installed)}"
        )
    if asked not in ("none", "auto", method):
        raise ConfigError(
            f"quantization={asked!r}, but {model_config.model} is a {method!r} checkpoint: its weights are computed "
            f"with {method!r} (leave quantization at auto or none, or name {method!r})"
        )
    cls = registry.load(GROUP, method)
    return cls.from_config(settings)


def _listing(names: list[str]) -> str:
    return ", ".join(names) if names else "none"
