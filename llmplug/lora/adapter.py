"""Reading a PEFT LoRA folder and checking it against the model's LoRA-capable layers.

A PEFT folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, `target_modules`, ...)
and `adapter_model.safetensors` with, per adapted module, `lora_A.weight` [r, in] and `lora_B.weight`
[out, r], named after the checkpoint's modules (`base_model.model.model.layers.0.self_attn.q_proj`).
Those names go through the model's own checkpoint name map, so `q_proj` lands on part "q" of our fused
`qkv_proj` and `gate_proj` on part 0 of `gate_up_proj`, as the base weights do. The scaling
(`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA) is folded into B once, here.

Everything that would not fit the model — another rank than the slots hold, a module the model has no
LoRA-capable layer for, shapes of another architecture, PEFT features this engine does not compute
(DoRA, biases, `modules_to_save`, per-module rank or alpha patterns) — is a LoRALoadError naming the
adapter and what is wrong, raised before any request using it is queued.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from llmplug.core.errors import InvalidRequestError
from llmplug.layers.weight_utils import ShardId
from llmplug.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRALoadError", "LoRATarget", "load_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# PEFT settings whose non-default value changes the computation in a way this engine does not model
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "use_dora": bool,
    "fan_in_fan_out": bool,
    "modules_to_save": bool,
    "rank_pattern": bool,
    "alpha_pattern": bool,
    "layers_to_transform": lambda v: v is not None,
    "bias": lambda v: v not in (None, "none"),
}

# (checkpoint module name) -> (our module name, part of it)
NameMap = Callable[[str], tuple[str, ShardId | None]]


class LoRALoadError(InvalidRequestError):
    """An adapter cannot be served by this engine; the message names the adapter and what does not fit."""


def _error(request: LoRARequest, why: str) -> LoRALoadError:
    # the message is built here, not in __init__, so the error pickles (it crosses from worker processes)
    return LoRALoadError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}", param="lora_request")


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """A layer an adapter may adapt: its full input width and the full output width of each part."""

    in_features: int
    out_features: Mapping[ShardId | None, int]  # part (shard id; None: the layer is not fused) -> rows


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights on the host, by our module and part: (A [r, in], B [out, r] times the scaling)."""

    request: LoRARequest
    rank: int
    weights: Mapping[str, Mapping[ShardId | None, tuple[torch.Tensor, torch.Tensor]]]


def load_adapter(
    request: LoRARequest, targets: Mapping[str, LoRATarget], name_map: NameMap, max_rank: int
) -> LoRAAdapter:
    """Read `request.lora_path` and check it against `targets` (our module name -> LoRATarget)."""
    folder = Path(request.lora_path)
    config = _read_config(request, folder)
    rank = _rank(request, config, max_rank)
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = _read_tensors(request, folder)
    weights: dict[str, dict[ShardId | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, (a, b) in _pairs(request, tensors).items():
        ours, part = name_map(module)
        target = targets.get(ours)
        if target is None or part not in target.out_features:
            raise _error(request, f"adapts {module!r}, which is not a linear layer this model can adapt")
        _check_shapes(request, module, a, b, rank, target.in_features, target.out_features[part])
        weights.setdefault(ours, {})[part] = (a.float(), b.float() * scaling)
    if not weights:
        raise _error(request, f"{WEIGHTS_FILE} holds no lora_A / lora_B weights")
    return LoRAAdapter(request, rank, weights)


def _read_config(request: LoRARequest, folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _error(request, f"no {CONFIG_FILE} in {folder} (lora_path must be a PEFT adapter folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _error(request, f"{CONFIG_FILE} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise _error(request, f"{CONFIG_FILE} is not a LoRA config (peft_type={config.get('peft_type')!r})")
    for key, is_set in _UNSUPPORTED.items():
        if is_set(config.get(key)):
            raise _error(request, f"{CONFIG_FILE} sets {key}={config[key]!r}, which llmplug does not support")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise _error(request, f"{CONFIG_FILE} needs a positive {key!r}, got {config.get(key)!r}")
    return config


def _rank(request: LoRARequest, config: dict[str, Any], max_rank: int) -> int:
    rank = int(config["r"])
    if rank > max_rank:
        raise _error(request, f"rank r={rank} exceeds max_lora_rank={max_rank}; raise lora.max_lora_rank")
    return rank


def _read_tensors(request: LoRARequest, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise _error(request, f"no {WEIGHTS_FILE} in {folder}")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        raise _error(request, f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from exc


def _pairs(request: LoRARequest, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint module name -> (lora_A, lora_B); any other tensor (embeddings, lm_head, biases) is an error."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        module, _, leaf = name.rpartition(".lora_")
        if leaf not in ("A.weight", "B.weight"):
            raise _error(request, f"tensor {key!r} is not a lora_A / lora_B weight of a linear layer")
        found.setdefault(module, {})[leaf[0]] = tensor
    incomplete = sorted(m for m, ab in found.items() if len(ab) != 2)
    if incomplete:
        raise _error(request, f"modules {incomplete} have only one of lora_A / lora_B")
    return {module: (ab["A"], ab["B"]) for module, ab in found.items()}


def _check_shapes(
    request: LoRARequest, module: str, a: torch.Tensor, b: torch.Tensor, rank: int, in_features: int, out: int
) -> None:
    expected = {"lora_A": (rank, in_features), "lora_B": (out, rank)}
    for label, tensor in (("lora_A", a), ("lora_B", b)):
        if tuple(tensor.shape) != expected[label]:
            raise _error(
                request,
                f"{module}.{label} has shape {tuple(tensor.shape)}, the model needs {expected[label]} "
                "(an adapter for another base model, or another rank than its config's r)",
            )
