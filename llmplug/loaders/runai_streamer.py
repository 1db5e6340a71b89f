"""RunaiStreamerLoader (`load.format: runai_streamer`): safetensors read by Run:ai's model streamer.

The streamer reads every file of the checkpoint with many threads at once into a bounded CPU buffer and
hands the tensors over as they arrive; they go through the model's one generic load_weights loop. Its
two knobs are LoadConfig fields: `runai_concurrency` (RUNAI_STREAMER_CONCURRENCY) and
`runai_memory_limit` (RUNAI_STREAMER_MEMORY_LIMIT, bytes). The streamer reads them from the environment,
so they are set there only while a model streams. Local directories only; see docs/loaders.md.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import torch

from llmplug.core.errors import ModelLoadError
from llmplug.loaders.base import BaseModelLoader
from llmplug.loaders.weights import find_weight_files, open_safetensors

if TYPE_CHECKING:
    from llmplug.core.config import ModelConfig

__all__ = ["RunaiStreamerLoader", "streamer_env"]

CONCURRENCY_ENV = "RUNAI_STREAMER_CONCURRENCY"
MEMORY_LIMIT_ENV = "RUNAI_STREAMER_MEMORY_LIMIT"


class RunaiStreamerLoader(BaseModelLoader):
    """Streams the checkpoint's *.safetensors files with runai-model-streamer."""

    def iter_weights(self, model_config: "ModelConfig") -> Iterable[tuple[str, torch.Tensor]]:
        """Every tensor of every safetensors file, in the order the streamer delivers them."""
        files, _ = find_weight_files(self.model_path(model_config.model), "safetensors")
        return _stream(files, self.load_config.runai_concurrency, self.load_config.runai_memory_limit)


@contextlib.contextmanager
def streamer_env(concurrency: int | None, memory_limit: int | None) -> Iterator[None]:
    """Set the streamer's environment knobs that are not None; restore the previous values after."""
    wanted = {CONCURRENCY_ENV: concurrency, MEMORY_LIMIT_ENV: memory_limit}
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update({name: str(value) for name, value in wanted.items() if value is not None})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _stream(files: list[Path], concurrency: int | None, memory_limit: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from the streamer; a damaged file is a ModelLoadError naming it."""
    from runai_model_streamer import SafetensorsStreamer

    with streamer_env(concurrency, memory_limit), SafetensorsStreamer() as streamer:
        try:
            streamer.stream_files([str(file) for file in files])
            yield from streamer.get_tensors()
        except Exception as error:  # the streamer raises plain Exception subclasses of its own
            raise ModelLoadError(_describe_failure(files, error)) from error


def _describe_failure(files: list[Path], error: Exception) -> str:
    """Name the file the streamer choked on: the first one safetensors itself refuses, else all of them."""
    for file in files:
        try:
            with open_safetensors(file):
                pass
        except ModelLoadError as broken:
            return f"runai_streamer: {broken} ({type(error).__name__}: {error})"
    return f"runai_streamer could not stream {', '.join(map(str, files))}: {type(error).__name__}: {error}"
