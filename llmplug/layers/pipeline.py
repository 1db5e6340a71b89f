"""Pipeline parallelism as a model sees it: which layers this stage holds, and what stages pass on.

A model that supports pipeline parallelism sets `supports_pipeline_parallel = True`, builds only the
layers `pp_layer_range` gives its stage (a `PPMissingLayer` keeps the place of every other one, so
parameter names stay the checkpoint's), and takes `forward(input_ids, positions, intermediate_tensors)`:
None on the first stage; on later stages the `IntermediateTensors` the previous stage returned.
Every stage but the last returns IntermediateTensors instead of hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from llmplug.communicators.parallel_state import get_pp_group

__all__ = ["IntermediateTensors", "PPMissingLayer", "pp_layer_range", "skip_missing_layers"]


@dataclass(slots=True)
class IntermediateTensors:
    """The named activations one pipeline stage hands the next (e.g. hidden states and residual)."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class PPMissingLayer(nn.Identity):
    """The place of a layer that another pipeline stage holds: no parameters, never called."""


def pp_layer_range(num_layers: int, pp_rank: int | None = None, pp_size: int | None = None) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` of `pp_size` holds (default: this process's stage).

    Layers split evenly; the remainder goes one each to the stages just before the last, which also
    computes the final norm and the logits.
    """
    group = get_pp_group()
    pp_rank = group.rank_in_group if pp_rank is None else pp_rank
    pp_size = group.world_size if pp_size is None else pp_size
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def skip_missing_layers(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors whose module this stage holds (drops those of its PPMissingLayers)."""
    missing = tuple(name + "." for name, module in model.named_modules() if isinstance(module, PPMissingLayer))
    for name, tensor in weights:
        if not name.startswith(missing):
            yield name, tensor
