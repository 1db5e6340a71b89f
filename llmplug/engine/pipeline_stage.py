"""PipelineStage: one worker's part of a pipeline-parallel forward pass.

Every stage runs each step with the same scheduler output. A stage after the first receives the
previous stage's IntermediateTensors (their names, shapes and dtypes over the CPU group, then the
tensors over the device group), runs its layers, and sends its own on; only the last stage returns
hidden states. Without pipeline parallelism `run` is a plain call of the model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from llmplug.communicators.parallel_state import GroupCoordinator, get_pp_group
from llmplug.core.errors import ConfigError
from llmplug.layers.pipeline import IntermediateTensors

__all__ = ["PipelineStage"]


class PipelineStage:
    """Runs the model for this process's pipeline stage and passes activations between stages."""

    def __init__(self, model: torch.nn.Module, group: GroupCoordinator | None = None) -> None:
        self.group = group or get_pp_group()
        if self.group.world_size > 1 and not getattr(model, "supports_pipeline_parallel", False):
            raise ConfigError(
                f"{type(model).__name__} does not support pipeline parallelism (no supports_pipeline_parallel); "
                "set parallel.pipeline_parallel_size to 1"
            )

    def run(
        self, model: Callable[..., Any], input_ids: torch.Tensor, positions: torch.Tensor, **model_kwargs: torch.Tensor
    ) -> torch.Tensor | None:
        """This stage's forward pass: hidden states [T, hidden] on the last stage, None on the others.

        `model_kwargs` (token_type_ids of pooling models) go to a model that runs whole, on one stage."""
        if self.group.world_size == 1:
            return model(input_ids, positions, **model_kwargs)
        received = None if self.group.is_first_rank else self._recv()
        out = model(input_ids, positions, received)
        if self.group.is_last_rank:
            return out
        self._send(out)
        return None

    def _send(self, intermediate: IntermediateTensors) -> None:
        tensors = intermediate.tensors
        self.group.send_object([(name, tuple(t.shape), t.dtype) for name, t in tensors.items()])
        for tensor in tensors.values():
            self.group.send(tensor)

    def _recv(self) -> IntermediateTensors:
        specs = self.group.recv_object()
        return IntermediateTensors({name: self.group.recv(shape, dtype) for name, shape, dtype in specs})
