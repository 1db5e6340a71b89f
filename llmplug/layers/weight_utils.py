"""Declarative weight loading: per-parameter `weight_loader`s and the one generic loading loop.

A model declares a name map such as `{"q_proj": ("qkv_proj", "q")}`: checkpoint module `q_proj` is
shard "q" of our fused `qkv_proj`. The loop renames each checkpoint tensor through the map, finds the
parameter and calls its `weight_loader(param, tensor[, shard_id])`; sharding (tensor parallelism,
fused projections) lives in each layer's loader, never in the model.

Mixture-of-experts layers keep every expert's weights in one stacked parameter; a checkpoint's
per-expert tensor `...experts.<e>.<proj>.<weight|bias>` loads into it with shard id `ExpertShard(e, part)`
through an `ExpertParamsMap` (`{"gate_proj": ("gate_up_proj", 0), ...}`). A parameter may declare the
shard ids that fill it (`expected_shards`), as a stacked experts parameter does.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from llmplug.core.errors import ModelLoadError

__all__ = [
    "ExpertParamsMap",
    "ExpertShard",
    "ShardId",
    "StackedParamsMap",
    "default_weight_loader",
    "frozen_parameter",
    "load_mapped_weights",
    "set_weight_loader",
]



@dataclass(frozen=True, slots=True)
class ExpertShard:
    """Shard id of one expert's projection inside a stacked experts parameter."""

    expert: int  # the expert's index in the checkpoint (all experts, not this rank's)
    part: int  # which projection of a fused parameter: 0 (gate, or the only one), 1 (up)


ShardId = str | int | ExpertShard
# checkpoint module name -> (our fused module name, shard id inside it)
StackedParamsMap = Mapping[str, tuple[str, ShardId]]
# per-expert checkpoint module (`experts.<e>.<name>`) -> (our stacked parameter's name, part of it)
ExpertParamsMap = Mapping[str, tuple[str, int]]


def set_weight_loader(param: torch.nn.Parameter, loader: Callable[..., None]) -> torch.nn.Parameter:
    """Attach `loader` as the parameter's `weight_loader` and return the parameter."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def frozen_parameter(data: torch.Tensor, loader: Callable[..., None]) -> torch.nn.Parameter:
    """An inference parameter (no grad) holding `data`, loaded by `loader`."""
    return set_weight_loader(torch.nn.Parameter(data, requires_grad=False), loader)


def check_shape(param: torch.Tensor, loaded: torch.Tensor, what: str = "weight") -> None:
    """ModelLoadError when the checkpoint tensor's shape differs from the parameter's."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ModelLoadError(
            f"{what} has shape {tuple(loaded.shape)} in the checkpoint but the model expects {tuple(param.shape)}; "
            "the checkpoint does not match its config"
        )


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy the whole tensor into the parameter (casting dtype); shapes must match."""
    check_shape(param, loaded_weight)
    param.data.copy_(loaded_weight)


def map_name(name: str, stacked: StackedParamsMap) -> tuple[str, ShardId | None]:
    """The parameter name and shard id of checkpoint tensor `name` (whole dotted components only)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in stacked:
            target, shard_id = stacked[part]
            return ".".join([*parts[:i], target, *parts[i + 1 :]]), shard_id
    return name, None


def map_expert_name(name: str, experts: ExpertParamsMap) -> tuple[str, ExpertShard] | None:
    """`<owner>.experts.<e>.<proj>.<leaf>` -> (`<owner>.experts.<param>[_<leaf>]`, ExpertShard(e, part)) when
    `proj` is in `experts` (leaf `weight`: the parameter itself; a quantized checkpoint's `weight_scale`, ...:
    `<param>_weight_scale`); None for any other name."""
    parts = name.split(".")
    if len(parts) < 4 or parts[-4] != "experts" or not parts[-3].isdigit() or parts[-2] not in experts:
        return None
    param, part = experts[parts[-2]]
    suffix = "" if parts[-1] == "weight" else "_" + parts[-1]
    return ".".join([*parts[:-3], param + suffix]), ExpertShard(int(parts[-3]), part)


def expected_shards(param_name: str, stacked: StackedParamsMap) -> frozenset[ShardId | None]:
    """The shard ids that together fill `param_name` ({None} for a parameter loaded whole)."""
    parts = set(param_name.split("."))
    shards = frozenset(shard for target, shard in stacked.values() if target in parts)
    return shards or frozenset({None})


def _has_suffix(name: str, suffixes: Iterable[str]) -> bool:
    """True when `name` ends with one of `suffixes` at a dot boundary."""
    return any(name == s or name.endswith("." + s) for s in suffixes)


def load_mapped_weights(
    module: torch.nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedParamsMap | None = None,
    ignored_suffixes: Iterable[str] = (),
    skipped_names: Iterable[str] = (),
    experts: ExpertParamsMap | None = None,
) -> set[str]:
    """Load (checkpoint name, tensor) pairs into `module`; return the names of fully loaded parameters.

    `experts` maps per-expert checkpoint tensors onto stacked experts parameters (see the module doc);
    it is consulted before `stacked`, whose names (gate_proj, ...) per-expert names also contain.

    `ignored_suffixes` and `skipped_names` are checkpoint tensors the model knowingly drops (e.g. rotary
    `inv_freq` buffers of old checkpoints, a tied `lm_head.weight`). Any other name the model has no
    parameter for is an error listing them all. A fused parameter counts as loaded once all its
    shards were seen; the caller decides whether missing parameters are an error.
    """
    stacked = stacked or {}
    params: dict[str, Any] = dict(module.named_parameters())
    ignored, skipped = tuple(ignored_suffixes), set(skipped_names)
    seen: dict[str, set[ShardId | None]] = defaultdict(set)
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            if name in skipped or _has_suffix(name, ignored):
                continue
            target, shard_id = (experts and map_expert_name(name, experts)) or map_name(name, stacked)
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            _load_one(param, tensor, shard_id, name)
            seen[target].add(shard_id)
    if unexpected:
        raise ModelLoadError(
            f"{len(unexpected)} checkpoint tensor(s) match no parameter of {type(module).__name__}: "
            f"{sorted(unexpected)}; the checkpoint is of another architecture or the name map lacks them"
        )
    return {name for name, shards in seen.items() if shards >= _expected(name, params[name], stacked)}


def _expected(name: str, param: torch.nn.Parameter, stacked: StackedParamsMap) -> frozenset[ShardId | None]:
    """The shard ids `param` declares (`expected_shards`), else those of the stacked map."""
    declared = getattr(param, "expected_shards", None)
    return declared if declared is not None else expected_shards(name, stacked)


def _load_one(param: torch.nn.Parameter, tensor: torch.Tensor, shard_id: ShardId | None, name: str) -> None:
    """Call the parameter's weight_loader; errors name the checkpoint tensor."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
    except ModelLoadError as error:
        raise ModelLoadError(f"checkpoint tensor {name!r}: {error}") from error


def missing_parameters(module: torch.nn.Module, loaded: set[str]) -> list[str]:
    """Parameters of `module` that `loaded` lacks, sorted."""
    return sorted(name for name, _ in module.named_parameters() if name not in loaded)
