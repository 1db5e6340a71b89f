"""A checkpoint's (name, tensor) pairs as the transformers model's own parameters, through transformers'
weight conversions (`get_model_conversion_mapping`): renamed keys, and tensors a model stores fused (one
[experts, ...] parameter from a checkpoint's per-expert tensors, gate and up concatenated, ...).

Renamed tensors pass straight through; tensors that a converter joins are held until the checkpoint has
been read, then converted and handed on, one target parameter at a time.
"""

from __future__ import annotations

import copy
from typing import Iterable, Iterator

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

__all__ = ["converted_weights"]


def converted_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], targets: set[str]
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(checkpoint name, parameter name, tensor) for each of `weights`, renamed and converted as transformers
    loads `model`; a name that matches no parameter of `targets` is yielded unchanged (the caller decides)."""
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    present = dict.fromkeys(targets, True)  # what rename_source_key consults to add or strip the base model prefix
    pending: dict[str, list[tuple[str, str, torch.Tensor]]] = {}  # target -> its sources (name, pattern, tensor)
    for name, tensor in weights:
        renamed, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, present)
        if renamed not in targets and name in targets:
            renamed, pattern = name, None
        if pattern is None or renamed not in targets:
            yield name, renamed, tensor
            continue
        pending.setdefault(renamed, []).append((name, pattern, tensor))
    for first_target, sources in pending.items():
        converter = copy.deepcopy(by_pattern[sources[0][1]])
        # in transformers' order (experts 0, 1, 2, ..., 10), which the stacking converters rely on
        for name, pattern, tensor in sorted(sources, key=lambda source: dot_natural_key(source[0])):
            converter.add_tensor(first_target, name, pattern, lambda t=tensor: t)  # a callable: read on convert
        for target, value in converter.convert(first_target, model=model, config=model.config).items():
            yield sources[0][0], target, value[0] if isinstance(value, list) else value
