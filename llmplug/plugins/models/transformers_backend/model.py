"""The transformers backend's models: a transformers model built on the meta device, materialised on the
engine's device, its attention run by llmplug's paged `Attention` (see attention.py) and its weights loaded
from llmplug's loaders as (name, tensor) pairs.

`TransformersForCausalLM` generates; `TransformersForEmbedding` is its pooling twin (the bare model, then
llmplug's `Pooler`). `backend_class(config)` says which one runs a config, or why none can.
"""

from __future__ import annotations

import abc
import copy
import re
from typing import Any, ClassVar, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.core.errors import ModelLoadError
from llmplug.layers.pooler import Pooler, PoolingMetadata, PoolingType
from llmplug.layers.weight_utils import default_weight_loader
from llmplug.plugins.models.transformers_backend import attention
from llmplug.plugins.models.transformers_backend.checkpoint import converted_weights
from llmplug.plugins.models.transformers_backend.support import (
    base_model_class,
    causal_lm_architectures,
    causal_lm_class,
    unsupported_reason,
)
from llmplug.plugins.models.transformers_backend.tensor_parallel import apply_tp_plan

__all__ = ["TransformersForCausalLM", "TransformersForEmbedding", "backend_class"]


def backend_class(config: PretrainedConfig) -> type[nn.Module]:
    """The backend class that runs `config` (its first architecture): the causal LM when transformers has that
    architecture as one, the embedding model for a bare model; ValueError naming the architecture otherwise."""
    architecture = (getattr(config, "architectures", None) or ["<none>"])[0]
    for backend, hf_class in ((TransformersForCausalLM, causal_lm_class(config)),
                              (TransformersForEmbedding, base_model_class(config))):
        if hf_class is not None and hf_class.__name__ == architecture:
            reason = unsupported_reason(hf_class, config)
            if reason is not None:
                raise ValueError(f"architecture {architecture!r} cannot run on the transformers backend: {reason}")
            return backend
    raise ValueError(
        f"architecture {architecture!r} is not registered natively (see `llmplug models`) and transformers has no "
        f"causal-LM or bare-model class of that name for model type {config.model_type!r}"
    )


class _TransformersModel(nn.Module, metaclass=abc.ABCMeta):
    """A transformers model (`self.model`) whose attention runs on llmplug's layers (`self.attention`)."""

    supports_pipeline_parallel: ClassVar[bool] = False
    supports_tensor_parallel: ClassVar[bool] = True  # through the model's base_model_tp_plan, where it has one
    family: ClassVar[str] = "transformers"

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = self._build(copy.deepcopy(config))
        self.attention = attention.make_attention_layers(self.model, config, get_tp_group().world_size)

    @staticmethod
    def batch_invariance_gap(config: PretrainedConfig) -> str | None:
        """The batch-invariant mode needs llmplug's layers; transformers' (nn.Linear, its activations) change with the batch."""
        return "it runs transformers' own layers, whose matmuls and activations round differently with the batch"

    @staticmethod
    def for_config(config: PretrainedConfig) -> type[nn.Module]:
        """The backend class that runs `config` (the loader asks the registered backend; see `backend_class`)."""
        return backend_class(config)

    @staticmethod
    @abc.abstractmethod
    def hf_class(config: PretrainedConfig) -> type:
        """The transformers class this backend model builds for `config`."""

    def _build(self, config: PretrainedConfig) -> nn.Module:
        """transformers' model on meta, its planned linears made parallel, then materialised on the engine's device."""
        hf_class = self.hf_class(config)
        reason = unsupported_reason(hf_class, config)
        if reason is not None:
            raise ValueError(reason)
        device = torch.get_default_device()  # the loader's device, entered around the model's construction
        attention.register()
        config._attn_implementation = attention.ATTN_IMPLEMENTATION
        with torch.device("meta"):
            model = hf_class._from_config(config, dtype=torch.get_default_dtype())
        tp_size = get_tp_group().world_size
        if tp_size > 1:
            base = model.base_model
            apply_tp_plan(base, getattr(base.config, "base_model_tp_plan", None), device, hf_class.__name__)
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gives tied parameters separate storage again
        _initialize_buffers(model)
        return model.eval()

    def _hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, base: nn.Module) -> torch.Tensor:
        """input_ids, positions [T] -> the bare model's last hidden states [T, hidden], run as a batch of one."""
        out = base(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
            **{attention.LAYERS_KWARG: self.attention},
        )
        return out[0][0]

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
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(f"model.{target}")
            elif not any(p.search(name) for p in ignored):
                raise ModelLoadError(
                    f"checkpoint tensor {name!r} matches no parameter of transformers' {type(self.model).__name__}"
                )
        return loaded

    def _kept(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is for this model (False: a part it knowingly drops)."""
        return True


class TransformersForCausalLM(_TransformersModel):
    """Any transformers causal LM whose class supports the attention interface, on llmplug's paged attention."""

    @staticmethod
    def hf_class(config: PretrainedConfig) -> type:
        hf_class = causal_lm_class(config)
        if hf_class is None:
            raise ValueError(f"transformers has no causal LM for model type {config.model_type!r}")
        return hf_class

    @staticmethod
    def architectures(model_types: Iterable[str] | None = None) -> dict[str, tuple[str | None, bool]]:
        """transformers' causal-LM class names (of `model_types`, default all) -> (why the backend cannot run them
        or None, whether they have a tensor-parallel plan); see `causal_lm_architectures`. Imports each class."""
        return causal_lm_architectures(model_types)

    @staticmethod
    def pooling_twin(convert: str) -> type[nn.Module]:
        """The class `model.convert` runs this architecture as (embed: TransformersForEmbedding)."""
        if convert != "embed":
            raise ValueError(f"model.convert={convert!r}: the transformers backend converts causal LMs to 'embed' only")
        return TransformersForEmbedding

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        _check_plain_head(self.model)
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return self._hidden_states(input_ids, positions, self.model.base_model)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]: the model's lm_head, then its final soft-cap if it has one."""
        logits = self.model.lm_head(hidden_states).float()
        cap = self.final_logit_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)


class TransformersForEmbedding(_TransformersModel):
    """A transformers bare model (or a causal LM's, with model.convert=embed) as an embedding model."""

    is_pooling_model: ClassVar[bool] = True

    @staticmethod
    def hf_class(config: PretrainedConfig) -> type:
        hf_class = base_model_class(config)
        if hf_class is None:
            raise ValueError(f"transformers has no bare model for model type {config.model_type!r}")
        return hf_class

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        causal = all(layer.causal for layer in self.attention)
        self.default_pooling_type = PoolingType.LAST if causal else PoolingType.CLS
        self._pooler = Pooler()

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The tasks this model pools for, its default first."""
        return self._pooler.tasks

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return self._hidden_states(input_ids, positions, self.model)

    def pooler(self, hidden_states: torch.Tensor, pooling_metadata: PoolingMetadata) -> list[torch.Tensor]:
        """One float32 result per pooled request (see llmplug.layers.pooler)."""
        return self._pooler(hidden_states, pooling_metadata)

    def _kept(self, name: str) -> bool:
        """A causal LM's checkpoint: its output head is dropped (transformers strips the base model prefix)."""
        return not name.startswith("lm_head.")


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


def _check_plain_head(model: nn.Module) -> None:
    """ValueError unless the causal LM is its bare model plus `lm_head` (the backend applies only lm_head)."""
    extra = [name for name, child in model.named_children()
             if name not in (model.base_model_prefix, "lm_head") and next(child.parameters(), None) is not None]
    if extra or not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise ValueError(
            f"{type(model).__name__}'s head is not one `lm_head` over its bare model (also: {extra}); "
            "the transformers backend computes logits with lm_head alone"
        )
