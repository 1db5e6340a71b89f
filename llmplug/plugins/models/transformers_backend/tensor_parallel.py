"""Tensor parallelism from a transformers model's own plan (`config.base_model_tp_plan`): each `nn.Linear`
the plan marks colwise or rowwise becomes llmplug's ColumnParallelLinear / RowParallelLinear, whose weight
loaders take this rank's slice and whose rowwise outputs are summed over the group (an all-reduce).

Everything else stays whole on every rank. Heads follow from the sharded projections: transformers'
attention reshapes q/k/v to (-1, head_dim), so each rank runs its own heads.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch
from torch import nn

from llmplug.layers.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["apply_tp_plan"]

PARALLEL_LINEAR = {"colwise": ColumnParallelLinear, "rowwise": RowParallelLinear}
# styles that leave the module whole on every rank (they only matter for training)
REPLICATED = frozenset({"replicated_with_grad_allreduce"})


def apply_tp_plan(base_model: nn.Module, plan: Mapping[str, str] | None, device: torch.device, name: str) -> None:
    """Replace `base_model`'s planned linear layers with parallel ones built on `device`; ValueError naming
    `name` (the model class) when there is no plan or a planned module is not a colwise/rowwise nn.Linear."""
    if not plan:
        raise ValueError(
            f"{name} has no tensor-parallel plan (config.base_model_tp_plan), so the transformers backend cannot "
            "shard it; run it with tensor_parallel_size=1"
        )
    patterns = [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in plan.items()]
    for qualname, module in list(base_model.named_modules()):
        style = next((style for pattern, style in patterns if pattern.fullmatch(qualname)), None)
        if style is None or style in REPLICATED:
            continue
        if style not in PARALLEL_LINEAR or not isinstance(module, nn.Linear):
            raise ValueError(
                f"{name}: the tensor-parallel plan shards {qualname} ({type(module).__name__}) as {style!r}; the "
                f"transformers backend shards only {sorted(PARALLEL_LINEAR)} nn.Linear layers"
            )
        with device:
            parallel = PARALLEL_LINEAR[style](module.in_features, module.out_features, module.bias is not None,
                                              prefix=qualname)
        parent, _, child = qualname.rpartition(".")
        setattr(base_model.get_submodule(parent), child, parallel)
