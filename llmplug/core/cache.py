"""llmplug's on-disk cache: what is costly to compute and the same on every start (row plans, GGUF tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """$LLMPLUG_CACHE_DIR, else $XDG_CACHE_HOME/llmplug, else ~/.cache/llmplug."""
    root = os.environ.get("LLMPLUG_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmplug"
