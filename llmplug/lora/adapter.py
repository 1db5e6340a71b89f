"""Reading a PEFT LoRA folder and checking it against the model's LoRA-capable layers.

A PEFT folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, `target_modules`, ...)
and `adapter_model.safetensors` with, per adapted module, `lora_A.weight` [r, in] and `lora_B.weight`
[out, r], named after the checkpoint's modules (`base_model.model.model.layers.0.self_attn.q_proj`).
Those names go through the model's own checkpoint name map, so `q_proj` lands on part "q" of our fused
`qkv_proj` and `gate_proj` on part 0 of `gate_up_proj`, as the base weights do (a vision-language model's
first through its `checkpoint_prefixes` onto its language model, the only part adapted: see manager.py).
The token embedding's pair is `lora_embedding_A` [r, vocab] / `lora_embedding_B` [dim, r], the LM head's
an ordinary lora_A / lora_B [vocab, r]. PEFT also saves the base embedding and head tables it wrapped
(`<module>.base_layer.weight`, `save_embedding_layers`); such a copy is accepted only when it equals the
model's own table (a different one is a resized or retrained vocabulary). The scaling (`lora_alpha / r`, or
`lora_alpha / sqrt(r)` with rsLoRA) is folded into B once, here.

Everything that would not fit the model — another rank than the slots hold, a module the model has no
LoRA-capable layer for, shapes of another architecture or vocabulary, PEFT features this engine does
not compute (DoRA, biases, `modules_to_save`, per-module rank or alpha patterns, `ensure_weight_tying`)
— is a LoRALoadError naming the adapter and what is wrong, raised before any request using it is queued.
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

__all__ = ["LoRAAdapter", "LoRALoadError", "LoRATarget", "NotAdaptable", "load_adapter"]

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
    "ensure_weight_tying": bool,
}
_WHY_UNSUPPORTED = {
    "modules_to_save": " (whole replacement layers, e.g. a retrained lm_head, are not served; "
                       "adapt the layer with LoRA instead)",
    "ensure_weight_tying": " (an lm_head delta derived from the embedding's; this engine applies each module's "
                           "own lora weights)",
}
_PAIRS = {"A.weight": "A", "B.weight": "B", "embedding_A": "A", "embedding_B": "B"}  # leaf after ".lora_"
BASE_COPY = ".base_layer.weight"

# (checkpoint module name) -> (our module name, part of it); NotAdaptable for a module outside what may be adapted
NameMap = Callable[[str], tuple[str, ShardId | None]]
# (our module name, a full table an adapter carries) -> whether it is the model's own
SameAsBase = Callable[[str, torch.Tensor], bool]


class LoRALoadError(InvalidRequestError):
    """An adapter cannot be served by this engine; the message names the adapter and what does not fit."""


class NotAdaptable(LookupError):
    """A name map's answer for a checkpoint module in a part of the model adapters may not adapt; says which."""


def _map(request: LoRARequest, name_map: NameMap, module: str) -> tuple[str, ShardId | None]:
    try:
        return name_map(module)
    except NotAdaptable as exc:
        raise _error(request, f"adapts {module!r}, {exc}") from None


def _error(request: LoRARequest, why: str) -> LoRALoadError:
    # the message is built here, not in __init__, so the error pickles (it crosses from worker processes)
    return LoRALoadError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}", param="lora_request")


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """A layer an adapter may adapt: its full input width and the full output width of each part."""

    in_features: int  # the vocabulary for an embedding
    out_features: Mapping[ShardId | None, int]  # part (shard id; None: the layer is not fused) -> rows
    embedding: bool = False  # adapted with lora_embedding_A / _B (a lookup), not lora_A / lora_B


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights on the host, by our module and part: (A [r, in], B [out, r] times the scaling)."""

    request: LoRARequest
    rank: int
    weights: Mapping[str, Mapping[ShardId | None, tuple[torch.Tensor, torch.Tensor]]]


def load_adapter(
    request: LoRARequest, targets: Mapping[str, LoRATarget], name_map: NameMap, max_rank: int, same_as_base: SameAsBase
) -> LoRAAdapter:
    """Read `request.lora_path` and check it against `targets` (our module name -> LoRATarget); a base table the
    adapter carries must pass `same_as_base`."""
    folder = Path(request.lora_path)
    config = _read_config(request, folder)
    rank = _rank(request, config, max_rank)
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = _read_tensors(request, folder)
    _check_base_copies(request, tensors, targets, name_map, same_as_base)
    weights: dict[str, dict[ShardId | None, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, (a, b, embedding) in _pairs(request, tensors).items():
        ours, part = _map(request, name_map, module)
        target = targets.get(ours)
        if target is None or part not in target.out_features:
            raise _error(request, f"adapts {module!r}, which is not a layer this model can adapt")
        if embedding != target.embedding:
            kind = ("an embedding (lora_embedding_A / _B)", "a linear layer (lora_A / lora_B)")
            raise _error(request, f"adapts {module!r} as {kind[not embedding]}, but it is {kind[not target.embedding]}")
        _check_shapes(request, module, a, b, rank, target.in_features, target.out_features[part], embedding)
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
            why = _WHY_UNSUPPORTED.get(key, "")
            raise _error(request, f"{CONFIG_FILE} sets {key}={config[key]!r}, which llmplug does not support{why}")
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


def _check_base_copies(
    request: LoRARequest, tensors: dict[str, torch.Tensor], targets: Mapping[str, LoRATarget], name_map: NameMap,
    same_as_base: SameAsBase,
) -> None:
    """Take out the base tables PEFT saved with an adapted embedding or head; each must be the model's own."""
    for key in [k for k in tensors if k.endswith(BASE_COPY)]:
        module = key.removeprefix(PEFT_PREFIX).removesuffix(BASE_COPY)
        ours, _ = _map(request, name_map, module)
        table = tensors.pop(key)
        if ours not in targets or not same_as_base(ours, table):
            raise _error(request, f"carries its own {module!r} table {tuple(table.shape)} ({key}), not the base "
                                  "model's: a resized or retrained vocabulary, which LoRA here does not serve")


def _pairs(
    request: LoRARequest, tensors: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, bool]]:
    """Checkpoint module name -> (A, B, whether an embedding's pair); any other tensor (biases...) is an error."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    embeddings: set[str] = set()
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        module, _, leaf = name.rpartition(".lora_")
        if leaf not in _PAIRS:
            raise _error(request, f"tensor {key!r} is not a lora_A / lora_B (or lora_embedding_A / _B) weight")
        found.setdefault(module, {})[_PAIRS[leaf]] = tensor
        if leaf.startswith("embedding"):
            embeddings.add(module)
    incomplete = sorted(m for m, ab in found.items() if len(ab) != 2)
    if incomplete:
        raise _error(request, f"modules {incomplete} have only one of lora_A / lora_B")
    return {module: (ab["A"], ab["B"], module in embeddings) for module, ab in found.items()}


def _check_shapes(
    request: LoRARequest, module: str, a: torch.Tensor, b: torch.Tensor, rank: int, in_features: int, out: int,
    embedding: bool,
) -> None:
    labels = ("lora_embedding_A", "lora_embedding_B") if embedding else ("lora_A", "lora_B")
    for label, tensor, expected in ((labels[0], a, (rank, in_features)), (labels[1], b, (out, rank))):
        if tuple(tensor.shape) != expected:
            raise _error(
                request,
                f"{module}.{label} has shape {tuple(tensor.shape)}, the model needs {expected} "
                "(an adapter for another base model or vocabulary size, or another rank than its config's r)",
            )
