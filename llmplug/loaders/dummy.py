"""DummyLoader (`load.format: dummy`): the model's architecture with random weights, for benchmarks
and tests. Needs only the config; values are reproducible from `model.seed` on any device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from llmplug.loaders.base import BaseModelLoader, LoadProgress

if TYPE_CHECKING:
    from llmplug.core.config import ModelConfig

__all__ = ["DummyLoader"]

DUMMY_RANGE = 1e-3  # small uniform values keep activations finite through many layers


class DummyLoader(BaseModelLoader):
    """Fills every parameter with uniform(-1e-3, 1e-3) drawn from a generator seeded with model.seed."""

    def iter_weights(self, model_config: "ModelConfig") -> Iterable[tuple[str, torch.Tensor]]:
        """Nothing to read: a dummy checkpoint has no files."""
        return ()

    def load_weights(self, model: torch.nn.Module, model_config: "ModelConfig", progress: LoadProgress) -> None:
        """Randomize every parameter in name order (drawn on the CPU so values match across devices)."""
        generator = torch.Generator(device="cpu").manual_seed(model_config.seed)
        with torch.no_grad():
            for _, param in model.named_parameters():
                values = torch.empty(param.shape, dtype=torch.float32).uniform_(
                    -DUMMY_RANGE, DUMMY_RANGE, generator=generator
                )
                param.data.copy_(values)
                progress.advance(param.numel() * param.element_size())
