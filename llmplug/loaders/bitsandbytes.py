"""BitsAndBytesLoader (`load.format: bitsandbytes`): the linear layers in bitsandbytes 4-bit (nf4, fp4) or 8-bit.

Two kinds of checkpoint, both read with the default loader's file discovery:

- full precision: every tensor carries the LoadConfig settings (`bnb_quant_type`, `bnb_double_quant`,
  `bnb_int8_threshold`) and each linear layer quantizes its checkpoint tensors with bitsandbytes as they
  arrive, one tensor at a time, as transformers does;
- already quantized by bitsandbytes (config.json `quantization_config.quant_method: bitsandbytes`, e.g.
  transformers' `save_pretrained` of a model loaded with `BitsAndBytesConfig`): each weight's quantized data
  and quant state are read as stored and reach the layer unchanged, behind a zero placeholder for the dense
  tensor; the checkpoint's own settings apply.

Either way the layers compute through bitsandbytes' kernels (layers/bitsandbytes.py); the LM head and
anything a checkpoint left unquantized stay dense, as in transformers. See docs/loaders.md.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from llmplug.core.errors import ModelLoadError
from llmplug.layers.bitsandbytes import BnbRows, BnbSettings, BnbSource, apply_bitsandbytes, attach_bnb
from llmplug.loaders.base import BaseModelLoader, record_stored_nbytes
from llmplug.loaders.weights import find_weight_files, safetensors_weights_iterator, weights_iterator

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from llmplug.core.config import ModelConfig

__all__ = ["BitsAndBytesLoader", "checkpoint_settings"]

log = logging.getLogger("llmplug.loaders")

# what transformers saves next to a 4-bit weight `P.weight` (as `P.weight.<key>`)
_STATE_KEYS_4BIT = (
    "absmax", "quant_map", "nested_absmax", "nested_quant_map",
    "quant_state.bitsandbytes__nf4", "quant_state.bitsandbytes__fp4",
)
# ... and next to an 8-bit weight (as `P.<key>`)
_STATE_KEYS_8BIT = ("SCB", "weight_format")


class BitsAndBytesLoader(BaseModelLoader):
    """Quantizes a full-precision checkpoint while loading, or reads a bitsandbytes-quantized one."""

    def iter_weights(self, model_config: "ModelConfig") -> Iterable[tuple[str, torch.Tensor]]:
        """Checkpoint tensors carrying their bitsandbytes form (or the settings to make it with)."""
        path = self.model_path(model_config.model)
        stored = checkpoint_settings(self.load_hf_config(model_config))
        if stored is None:
            files, kind = find_weight_files(path, "auto")
            source = BnbSource(settings=self.settings())
            return ((name, attach_bnb(tensor, source)) for name, tensor in weights_iterator(files, kind))
        files, kind = find_weight_files(path, "safetensors")
        return _prequantized_weights(files, stored)

    def settings(self) -> BnbSettings:
        """The quantization LoadConfig asks for (used for full-precision checkpoints)."""
        load = self.load_config
        return BnbSettings(load.bnb_quant_type, double_quant=load.bnb_double_quant, int8_threshold=load.bnb_int8_threshold)

    def process_weights_after_loading(self, model: torch.nn.Module, model_config: "ModelConfig") -> None:
        """Swap each staged linear layer to its bitsandbytes module (instead of int4 copies)."""
        if model_config.quantization == "int4":
            raise ModelLoadError("quantization=int4 cannot be combined with load.format=bitsandbytes; use none")
        count = apply_bitsandbytes(model)
        if count == 0:
            raise ModelLoadError(f"no linear layer of {model_config.model!r} got a bitsandbytes weight")
        log.info("bitsandbytes: %d linear layers quantized", count)


def _quantization_config(hf_config: "PretrainedConfig") -> dict[str, Any]:
    config = getattr(hf_config, "quantization_config", None) or {}
    return config if isinstance(config, dict) else config.to_dict()


def checkpoint_settings(hf_config: "PretrainedConfig") -> BnbSettings | None:
    """The settings a bitsandbytes-quantized checkpoint was saved with; None for a full-precision one."""
    config = _quantization_config(hf_config)
    if not config:
        return None
    if config.get("quant_method") != "bitsandbytes":
        raise ModelLoadError(
            f"the checkpoint is quantized with {config.get('quant_method')!r}, which load.format=bitsandbytes cannot read"
        )
    threshold = float(config.get("llm_int8_threshold", 6.0))
    if config.get("load_in_4bit"):
        return BnbSettings(config.get("bnb_4bit_quant_type", "fp4"), int8_threshold=threshold)
    if config.get("load_in_8bit"):
        return BnbSettings("int8", int8_threshold=threshold)
    raise ModelLoadError(f"bitsandbytes quantization_config sets neither load_in_4bit nor load_in_8bit: {config}")


def _state_owner(name: str) -> tuple[str, str] | None:
    """(weight name, state key) when checkpoint tensor `name` is part of a quantized weight's state."""
    for key in _STATE_KEYS_4BIT:
        if name.endswith(f".weight.{key}"):
            return name[: -len(key) - 1], key
    for key in _STATE_KEYS_8BIT:
        if name.endswith(f".{key}"):
            return name[: -len(key)] + "weight", key
    return None


def _prequantized_weights(files: list[Path], settings: BnbSettings) -> Iterator[tuple[str, torch.Tensor]]:
    """Every dense tensor as stored; every quantized weight as a placeholder carrying its form."""
    states: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in safetensors_weights_iterator(files, keep=lambda n: _state_owner(n) is not None):
        weight, key = _state_owner(name)
        states[weight][key] = tensor
    for name, tensor in safetensors_weights_iterator(files, keep=lambda n: _state_owner(n) is None):
        state = states.pop(name, None)
        if state is None and not tensor.is_floating_point():
            raise ModelLoadError(f"bitsandbytes weight {name!r} in {files[0].parent} has no quant state")
        yield name, tensor if state is None else _placeholder(name, tensor, state, settings, files)
    if states:
        raise ModelLoadError(f"{files[0].parent}: quant state without its weight for {sorted(states)}")


def _placeholder(
    name: str, data: torch.Tensor, state: dict[str, torch.Tensor], settings: BnbSettings, files: list[Path]
) -> torch.Tensor:
    """A zero stand-in, shaped like the dense weight, that carries the stored form to the layer."""
    try:
        rows = _rows_4bit(data, state, settings) if settings.is_4bit else _rows_8bit(data, state, settings)
    except (ValueError, KeyError, AssertionError, RuntimeError) as error:
        where = ", ".join(str(f) for f in files)
        raise ModelLoadError(f"bitsandbytes weight {name!r} in {where} has a broken quant state: {error}") from error
    stand_in = torch.zeros((), dtype=torch.float32).expand(rows.data.shape[0], rows.in_features)
    stored = data.nbytes + sum(t.nbytes for t in state.values())
    return record_stored_nbytes(attach_bnb(stand_in, BnbSource(rows=rows)), stored)


def _rows_4bit(data: torch.Tensor, state: dict[str, torch.Tensor], settings: BnbSettings) -> BnbRows:
    from bitsandbytes.functional import QuantState

    quant_state = QuantState.from_dict(dict(state), device=torch.device("cpu"))
    return BnbRows.from_4bit(data, quant_state, settings)


def _rows_8bit(data: torch.Tensor, state: dict[str, torch.Tensor], settings: BnbSettings) -> BnbRows:
    if data.dtype != torch.int8 or data.dim() != 2:
        raise ValueError(f"an 8-bit weight must be a 2-D int8 tensor, got {data.dtype} {tuple(data.shape)}")
    scale = state["SCB"]
    if scale.shape != (data.shape[0],):
        raise ValueError(f"SCB has shape {tuple(scale.shape)}, expected ({data.shape[0]},)")
    return BnbRows(data, scale.float(), settings, None, torch.float16)
