"""What every model of the transformers backend shares: transformers' class built on the meta device and
materialised on the engine's device, its weights loaded from llmplug's loaders as (name, tensor) pairs through
transformers' own names and conversions, and (for the paged models) its decoder's attention run by llmplug's
paged `Attention` (attention.py).
"""

from __future__ import annotations

import copy
import re
from typing import Callable, ClassVar, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.core.errors import ModelLoadError
from llmplug.plugins.models.transformers_backend import attention
from llmplug.plugins.models.transformers_backend.checkpoint import converted_weights
from llmplug.plugins.models.transformers_backend.quantized import apply_quantized_linears, load_dense
from llmplug.plugins.models.transformers_backend.support import unsupported_reason
from llmplug.plugins.models.transformers_backend.tensor_parallel import apply_tp_plan

__all__ = ["TransformersModel", "check_plain_head"]


class TransformersModel(nn.Module):
    """A transformers model (`self.model`); with `paged`, its decoder's attention runs on llmplug's layers
    (`self.attention`), else on transformers' own attention (whole prompts, no KV cache)."""

    supports_pipeline_parallel: ClassVar[bool] = False
    supports_tensor_parallel: ClassVar[bool] = True  # through the model's base_model_tp_plan, where it has one
    family: ClassVar[str] = "transformers"
    paged: ClassVar[bool] = True

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = self._build(copy.deepcopy(config))
        if self.paged:
            self.attention = attention.make_attention_layers(
                self.decoder, config.get_text_config(), get_tp_group().world_size)

    @staticmethod
    def batch_invariance_gap(config: PretrainedConfig) -> str | None:
        """The batch-invariant mode needs llmplug's layers; transformers' (nn.Linear, its activations) change with the batch."""
        return "it runs transformers' own layers, whose matmuls and activations round differently with the batch"

    @staticmethod
    def for_config(config: PretrainedConfig) -> type[nn.Module]:
        """The backend class that runs `config` (the loader asks the registered backend; see model.backend_class)."""
        from llmplug.plugins.models.transformers_backend.model import backend_class

        return backend_class(config)

    # how a subclass finds the transformers class it builds (a finder of support.py), and what that class is called
    find_hf_class: ClassVar[Callable[[PretrainedConfig], type | None]]
    hf_class_kind: ClassVar[str]

    @classmethod
    def hf_class(cls, config: PretrainedConfig) -> type:
        """The transformers class this backend model builds for `config`; ValueError where transformers has none."""
        hf_class = cls.find_hf_class(config)
        if hf_class is None:
            raise ValueError(f"transformers has no {cls.hf_class_kind} for model type {config.model_type!r}")
        return hf_class

    @staticmethod
    def refusal(hf_class: type, config: PretrainedConfig) -> str | None:
        """Why the backend cannot run `hf_class` on `config` (None: it can); see support.py."""
        return unsupported_reason(hf_class, config)

    @property
    def decoder(self) -> nn.Module:
        """The module whose attention modules run on llmplug's layers (a multimodal model's language model)."""
        return self.model

    def attn_implementation(self, config: PretrainedConfig) -> str | dict[str, str] | None:
        """transformers' attention implementation(s) to build with (None: transformers' default)."""
        return attention.ATTN_IMPLEMENTATION if self.paged else None

    def _build(self, config: PretrainedConfig) -> nn.Module:
        """transformers' model on meta, its planned linears made parallel and its quantized ones llmplug's layers
        (quantized.py), then materialised on the engine's device."""
        hf_class = self.hf_class(config)
        if self.paged:
            reason = self.refusal(hf_class, config)
            if reason is not None:
                raise ValueError(reason)
            attention.register()
        implementation = self.attn_implementation(config)
        if implementation is not None:
            config._attn_implementation = implementation
        device = torch.get_default_device()  # the loader's device, entered around the model's construction
        with torch.device("meta"):
            model = hf_class._from_config(config, dtype=torch.get_default_dtype())
        tp_size = get_tp_group().world_size
        if tp_size > 1:
            if not self.supports_tensor_parallel:
                raise ValueError(f"{type(self).__name__} runs {hf_class.__name__} whole on one worker; run it with "
                                 "tensor_parallel_size=1")
            base = model.base_model
            apply_tp_plan(base, getattr(base.config, "base_model_tp_plan", None), device, hf_class.__name__)
        apply_quantized_linears(model, config, device)  # a quantized checkpoint's linears hold its packed tensors
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gives tied parameters separate storage again
        _initialize_buffers(model)
        return model.eval()

    def _hidden_states(self, input_ids: torch.Tensor | None, positions: torch.Tensor, base: nn.Module,
                       inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (or inputs_embeds [T, hidden]), positions [T] -> the paged decoder's last hidden states
        [T, hidden], run as a batch of one."""
        tokens = {"input_ids": input_ids[None]} if inputs_embeds is None else {"inputs_embeds": inputs_embeds[None]}
        out = base(**tokens, position_ids=positions[None], use_cache=False, **{attention.LAYERS_KWARG: self.attention})
        return out[0][0]

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]: the model's lm_head, then its text config's final soft-cap."""
        logits = self.model.lm_head(hidden_states).float()
        cap = getattr(self.config.get_text_config(), "final_logit_softcapping", None)
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors through transformers' own names and conversions; returns the loaded parameter
        names. A tensor matching no parameter is an error, unless transformers itself ignores it."""
        targets = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        ignored = _ignored_patterns(self.model)
        loaded = set()
        kept = ((name, tensor) for name, tensor in weights if self._kept(name))
        for name, target, tensor in converted_weights(self.model, kept, set(targets)):
            if target in targets:
                param = targets[target]
                getattr(param, "weight_loader", load_dense)(param, tensor)
                loaded.add(f"model.{target}")
            elif not any(p.search(name) for p in ignored):
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} matches no parameter of transformers' {type(self.model).__name__}"
                )
        return loaded

    def _kept(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is for this model (False: a part it knowingly drops)."""
        return True


def _initialize_buffers(model: nn.Module) -> None:
    """Give the materialised model's buffers (rotary frequencies, position ids, ...) their values through
    transformers' own initialisation, leaving the (still empty) parameters to the loader."""
    for param in model.parameters():
        param._is_hf_initialized = True  # transformers' init functions skip what carries this flag
    model.initialize_weights()


def _ignored_patterns(model: nn.Module) -> list[re.Pattern[str]]:
    """Checkpoint names transformers itself ignores when loading the class (old buffers, tied copies)."""
    keys = [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []), r"rotary_emb\.inv_freq$"]
    keys += [re.escape(key) + "$" for key in getattr(model, "all_tied_weights_keys", {}) or {}]
    return [re.compile(key) for key in keys]


def check_plain_head(model: nn.Module) -> None:
    """ValueError unless the model is its bare model plus `lm_head` (the backend applies only lm_head)."""
    extra = [name for name, child in model.named_children()
             if name not in (model.base_model_prefix, "lm_head") and next(child.parameters(), None) is not None]
    if extra or not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise ValueError(
            f"{type(model).__name__}'s head is not one `lm_head` over its bare model (also: {extra}); "
            "the transformers backend computes logits with lm_head alone"
        )
