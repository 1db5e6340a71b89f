"""Example loader plugin: `load.format: npz` reads a model's weights from one NumPy archive, `weights.npz`.

A new weight format is a `BaseModelLoader` subclass that yields (checkpoint name, tensor) pairs. The
base class does the rest: it finds the model (a local folder, or a snapshot in the Hugging Face cache,
offline), reads its config.json and tokenizer, builds the model on the worker's device, feeds the
pairs to the model's weight loaders through the shared progress bar and load log, and checks that
every parameter got a value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from llmplug.core.errors import ModelLoadError
from llmplug.loaders.base import BaseModelLoader

LLMPLUG_PLUGIN_API_VERSION = "1.0"

WEIGHTS_FILE = "weights.npz"


class NpzLoader(BaseModelLoader):
    """Weights from `weights.npz` next to config.json: one array per HF checkpoint name."""

    def weights_file(self, model_config: Any) -> Path:
        """The archive of `model_config.model`; ModelLoadError naming it when it is missing."""
        path = Path(self.model_path(model_config.model)) / WEIGHTS_FILE
        if not path.is_file():
            raise ModelLoadError(
                f"load.format npz: {path} does not exist; write the state dict with numpy.savez({WEIGHTS_FILE!r}, ...)"
            )
        return path

    def download_model(self, model_config: Any) -> None:
        """Called once by the engine before its workers start: fail early when the model or its archive is missing."""
        self.weights_file(model_config)

    def iter_weights(self, model_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """Every array of the archive as a tensor, read one at a time (allow_pickle=False: data only)."""
        with np.load(self.weights_file(model_config), allow_pickle=False) as archive:
            for name in archive.files:
                yield name, torch.from_numpy(archive[name])
