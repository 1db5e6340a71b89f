"""DefaultLoader: Hugging Face checkpoints — safetensors (single or sharded, memory-mapped) or
torch .bin/.pt files (weights_only). Serves load formats `default`, `safetensors` and `pt`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from llmplug.loaders.base import BaseModelLoader
from llmplug.loaders.weights import find_weight_files, weights_iterator

if TYPE_CHECKING:
    from llmplug.core.config import ModelConfig

__all__ = ["DefaultLoader"]


class DefaultLoader(BaseModelLoader):
    """Reads *.safetensors (preferred) or *.bin / *.pt; `load.format` "safetensors" or "pt" insists on one."""

    def iter_weights(self, model_config: "ModelConfig") -> Iterable[tuple[str, torch.Tensor]]:
        """Every tensor of the checkpoint's weight files, one file open at a time."""
        files, kind = find_weight_files(self.model_path(model_config.model), self.load_config.format)
        return weights_iterator(files, kind)
