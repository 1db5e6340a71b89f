"""The worker's adapters: a host-side LRU cache of loaded adapters and `max_loras` device slots, also LRU.

`LoRAManager(model, config, ...)` attaches a `LoRASlots` to every linear layer of the model, its token
embedding and its LM head (the layers' `lora` hook); of a vision-language model, to those of its language model
only (the vision tower and projector stay the base model's, so an image's rows, which the encoder cache shares
between requests, never depend on an adapter). `add_adapter` loads and checks a PEFT folder into
the host cache (the engine calls it before queueing a request, so a bad adapter never reaches a step). Each step,
`mapping(lora_ids)` puts the step's adapters into slots — evicting the least recently used adapter
that the step does not need; the scheduler admits at most `max_loras` distinct adapters, so one
is always free — and returns the per-token `LoRAMapping` the layers read from the forward context.
An adapter evicted from the host cache is read from its folder again when a request needs it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch
from torch import nn

from llmplug.communicators.parallel_state import get_pp_group
from llmplug.core.config import LoRAConfig
from llmplug.core.errors import ConfigError
from llmplug.layers.linear import LinearBase
from llmplug.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmplug.layers.weight_utils import ShardId, map_name
from llmplug.lora.adapter import LoRAAdapter, NameMap, NotAdaptable, load_adapter
from llmplug.lora.layers import Adaptable, LoRAMapping, lora_slots, lora_target
from llmplug.lora.request import LoRARequest

if TYPE_CHECKING:
    from llmplug.layers.decoder import DecoderForCausalLM

__all__ = ["LoRAManager"]

logger = logging.getLogger(__name__)


class LoRAManager:
    """Host cache and device slots of one worker's adapters."""

    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device):
        if get_pp_group().world_size > 1:
            raise ConfigError("lora.enable_lora with pipeline_parallel_size > 1 is not supported: an adapter's layers "
                              "would be split over the stages; use tensor parallelism")
        self.config, self.dtype, self.device = config, dtype, device
        decoder, to_decoder = _language_model(model)
        self.name_map = _name_map(decoder, to_decoder)
        self.layers: dict[str, Adaptable] = {  # by the decoder's own module names
            name: module for name, module in decoder.named_modules() if _adaptable(module)
        }
        self.targets = {name: lora_target(layer) for name, layer in self.layers.items()}
        for layer in self.layers.values():
            layer.lora = lora_slots(layer, config.max_loras, config.max_lora_rank, dtype, device)
        self.cached: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> device slot, LRU first

    # ---- the host cache ---------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> None:
        """Load and check `request`'s folder into the host cache (LoRALoadError when it does not fit)."""
        known = self.cached.get(request.lora_int_id)
        if known is not None and known.request == request:
            self.cached.move_to_end(request.lora_int_id)
            return
        adapter = load_adapter(request, self.targets, self.name_map, self.config.max_lora_rank, self._is_base_table)
        self.remove_adapter(request.lora_int_id)  # a new folder under a known id replaces the old weights
        self.cached[request.lora_int_id] = adapter
        while len(self.cached) > self.config.cpu_capacity:
            evicted, _ = self.cached.popitem(last=False)
            logger.debug("LoRA adapter %d left the host cache", evicted)

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (host cache and slot); False when it was not loaded."""
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._fill_slot(slot, None)
        return self.cached.pop(lora_int_id, None) is not None or slot is not None

    def _is_base_table(self, name: str, table: torch.Tensor) -> bool:
        """Whether `table` (a full [vocab, dim] table an adapter carries) is the vocabulary layer `name`'s own."""
        layer = self.layers[name]
        if not isinstance(layer, VocabParallelEmbedding) or tuple(table.shape) != (layer.num_embeddings,
                                                                                   layer.embedding_dim):
            return False
        rows = layer.vocab_end - layer.vocab_start
        mine = table[layer.vocab_start : layer.vocab_end].to(device=layer.weight.device, dtype=layer.weight.dtype)
        return torch.equal(mine, layer.weight[:rows])

    def adapter_ids(self) -> list[int]:
        """Ids of the adapters in the host cache."""
        return list(self.cached)

    # ---- the device slots -------------------------------------------------------------------------
    def mapping(self, token_loras: Sequence[LoRARequest | None], query_lens: np.ndarray) -> LoRAMapping | None:
        """The mapping of a step whose requests (in batch order, `query_lens` tokens each) use `token_loras`."""
        used = list(dict.fromkeys(r for r in token_loras if r is not None))
        if not used:
            return None
        slot_of = dict(zip((r.lora_int_id for r in used), self._activate(used)))
        req_slot = np.array([-1 if r is None else slot_of[r.lora_int_id] for r in token_loras], dtype=np.int64)
        token_slot = np.repeat(req_slot, query_lens)  # [T]; -1: the base model
        mask = np.zeros((token_slot.shape[0], max(slot_of.values()) + 1), dtype=np.float32)  # [T, U]
        rows = np.flatnonzero(token_slot >= 0)
        mask[rows, token_slot[rows]] = 1.0
        return LoRAMapping(mask=torch.from_numpy(mask).to(device=self.device, dtype=self.dtype))

    def _activate(self, used: list[LoRARequest]) -> list[int]:
        """The slot of each adapter in `used`, loading the missing ones into free or least recently used slots."""
        needed = {r.lora_int_id for r in used}
        if len(needed) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} adapters but there are max_loras={self.config.max_loras}")
        slots = []
        for request in used:
            slot = self.slot_of.get(request.lora_int_id)
            if slot is None:
                slot = self._free_slot(needed)
                self._fill_slot(slot, self._adapter(request))
            self.slot_of[request.lora_int_id] = slot
            self.slot_of.move_to_end(request.lora_int_id)
            slots.append(slot)
        return slots

    def _free_slot(self, needed: set[int]) -> int:
        taken = set(self.slot_of.values())
        free = next((s for s in range(self.config.max_loras) if s not in taken), None)
        if free is not None:
            return free
        victim = next(i for i in self.slot_of if i not in needed)  # least recently used first
        return self.slot_of.pop(victim)

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        if request.lora_int_id not in self.cached or self.cached[request.lora_int_id].request != request:
            self.add_adapter(request)  # evicted from the host cache since: read again
        self.cached.move_to_end(request.lora_int_id)
        return self.cached[request.lora_int_id]

    def _fill_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for name, layer in self.layers.items():
            layer.lora.set_slot(slot, None if adapter is None else adapter.weights.get(name))


def _adaptable(module: nn.Module) -> bool:
    """A linear layer, a token (or token-type) embedding or the LM head; not a learned position table."""
    return isinstance(module, (LinearBase, ParallelLMHead)) or type(module) is VocabParallelEmbedding


def _language_model(model: nn.Module) -> tuple[DecoderForCausalLM, Callable[[str], str]]:
    """The generic decoder adapters adapt, and the map of an adapter's module name onto the decoder's checkpoint
    names: the identity for a text model; a vision-language model's `checkpoint_part` (the routing of its checkpoint
    layouts), which refuses its vision tower's and projector's modules."""
    from llmplug.layers.decoder import DecoderForCausalLM

    if isinstance(model, DecoderForCausalLM):
        return model, lambda module: module
    route = getattr(model, "checkpoint_part", None)  # a vision-language model's (llava.py)
    decoder = getattr(model, "language_model", None)
    if route is None or not isinstance(decoder, DecoderForCausalLM):
        raise ConfigError(f"lora.enable_lora: {type(model).__name__} is not built on the generic decoder, "
                          "the only model LoRA adapters can be applied to")

    def to_decoder(module: str) -> str:
        part, inner = route(module + ".weight") or ("", "")  # the prefixes route tensor names (`lm_head.` ...)
        if part != "language_model":
            where = f"a module of its {part}" if part else "a module of none of its parts"
            raise NotAdaptable(f"{where}: on {type(model).__name__} LoRA adapts the language model only (give peft "
                               "target_modules that match only it, e.g. r'.*language_model.*\\.(q_proj|v_proj)')")
        return inner.removesuffix(".weight")

    return decoder, to_decoder


def _name_map(model: DecoderForCausalLM, to_decoder: Callable[[str], str]) -> NameMap:
    """Checkpoint module name -> (our module, part), through the model's own checkpoint names and fused map."""
    from llmplug.layers.decoder import stacked_params

    cls = type(model)
    names = cls.checkpoint_names if cls.checkpoint_names_of is None else cls.checkpoint_names_of(model.config)
    stacked = stacked_params(model.arch)

    def name_map(module: str) -> tuple[str, ShardId | None]:
        return map_name(names.rename(to_decoder(module) + ".weight").removesuffix(".weight"), stacked)

    return name_map

