"""`python -m llmplug.layers.kernels.native`: build llmplug's CPU kernels now (`make setup` does), say where."""

from __future__ import annotations

import logging
import sys

from llmplug.layers.kernels.native import build_directory, native_available

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not native_available():
        sys.exit("llmplug's CPU kernels could not be built: the layers will use their torch paths")
    print(f"llmplug's CPU kernels: {build_directory()}")
