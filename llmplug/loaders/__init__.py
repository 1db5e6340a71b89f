"""Weight loaders, one per `load.format` (the `llmplug.loaders` entry-point group).

Exports `resolve_load_format`, which turns `load.format: auto` into a registered name, and
`build_loader`, which makes the loader of a format from an engine's registry. The loader classes live
in their modules (`base.BaseModelLoader`, `default.DefaultLoader`, `dummy.DummyLoader`, `gguf`, ...)
and are reached through the registry.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmplug.core.config import LoadConfig
    from llmplug.core.plugins import PluginRegistry

__all__ = ["build_loader", "resolve_load_format"]


def build_loader(registry: PluginRegistry, fmt: str, load_config: LoadConfig) -> Any:
    """The loader registered as `fmt`, constructed with `load_config`; a BaseModelLoader also gets
    `registry` (where it finds the model class). A loader implementing only the ModelLoader protocol is
    constructed as the protocol says, with the load config alone."""
    from llmplug.loaders.base import BaseModelLoader

    cls = registry.load("llmplug.loaders", fmt)
    if isinstance(cls, type) and issubclass(cls, BaseModelLoader):
        return cls(load_config, registry=registry)
    return cls(load_config)

_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def resolve_load_format(model_path: str, requested: str) -> str:
    """`requested` unless it is "auto": then "gguf" for a .gguf file (or a folder holding only
    GGUF weights), "bitsandbytes" for a folder whose config.json says bitsandbytes quantized it,
    "sharded_state" for a folder `llmplug save-sharded` wrote, else "default". Embedded short names
    resolve to their file first."""
    if requested != "auto":
        return requested
    from llmplug.loaders.default_model import resolve_model_path

    path = resolve_model_path(model_path)
    if os.path.isfile(path):
        return "gguf" if path.lower().endswith(".gguf") else "default"
    if os.path.isdir(path) and _holds_only_gguf(path):
        return "gguf"
    if os.path.isdir(path) and _quant_method(path) == "bitsandbytes":
        return "bitsandbytes"
    if os.path.isfile(os.path.join(path, "sharded_state.json")):  # sharded_state.LAYOUT_FILE (a light module here)
        return "sharded_state"
    return "default"


def _quant_method(folder: str) -> str | None:
    """config.json's quantization_config.quant_method, if any (a missing or unreadable config: None)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return None
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return quantization.get("quant_method") if isinstance(quantization, dict) else None


def _holds_only_gguf(folder: str) -> bool:
    """True when the folder has a .gguf file and no other weight files."""
    names = [name.lower() for name in os.listdir(folder)]
    has_gguf = any(name.endswith(".gguf") for name in names)
    return has_gguf and not any(name.endswith(_CHECKPOINT_SUFFIXES) for name in names)
