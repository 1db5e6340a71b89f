"""transformers' attention interface onto llmplug's paged `Attention`: one llmplug layer per transformers
attention module (matched by its `layer_idx`), so the KV cache, prefix caching, continuous batching and
chunked prefill work as for a native model.

The model runs on the step's flattened batch as a batch of one, with the positions as `position_ids`; the
per-request structure reaches the llmplug layers through the forward context, as for every model.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from llmplug.layers.attention import Attention

__all__ = ["ATTN_IMPLEMENTATION", "LAYERS_KWARG", "attention_modules", "make_attention_layers", "register"]

ATTN_IMPLEMENTATION = "llmplug"  # config._attn_implementation of every model the backend builds
LAYERS_KWARG = "llmplug_attention"  # the forward keyword carrying the model's llmplug layers down to attention


def register() -> None:
    """Make `ATTN_IMPLEMENTATION` a transformers attention implementation (idempotent, process-wide).

    No mask function is registered with it: transformers then builds no mask, which paged attention
    does not need (each request's causal structure is in the step's metadata)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key and value [1, Hkv, T, D] -> ([1, T, H, D], None), through the module's llmplug layer."""
    layers: Sequence[Attention] | None = kwargs.get(LAYERS_KWARG)
    if layers is None:
        raise RuntimeError(
            f"{type(module).__name__}: attention implementation {ATTN_IMPLEMENTATION!r} needs the llmplug layers "
            f"passed as `{LAYERS_KWARG}` to the model's forward (the transformers backend does)"
        )
    layer = layers[module.layer_idx]
    _check_call(layer, module, query, key, value, scaling, kwargs)
    num_tokens = query.shape[2]
    flat = lambda x: x[0].transpose(0, 1).reshape(num_tokens, -1)  # noqa: E731  [1, H, T, D] -> [T, H * D]
    out = layer(flat(query), flat(key), flat(value))  # [T, H * D]
    return out.view(1, num_tokens, layer.num_heads, layer.head_dim), None


def _check_call(
    layer: Attention,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> None:
    """RuntimeError naming the module when the call asks for something its llmplug layer was not built for."""
    where = f"{type(module).__name__} (layer {module.layer_idx})"
    if query.shape[0] != 1:
        raise RuntimeError(f"{where}: the backend runs a flattened batch of one, got batch {query.shape[0]}")
    got = (query.shape[1], key.shape[1], query.shape[3], value.shape[3])
    built = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.head_dim)
    if got != built:
        raise RuntimeError(f"{where}: (heads, kv heads, head dim, value dim) {got} != {built} built from the config")
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    if not math.isclose(scale, layer.scale, rel_tol=1e-6):
        raise RuntimeError(f"{where}: attention scale {scale} differs from the {layer.scale} its layer was built with")
    if kwargs.get("sliding_window") != layer.sliding_window:
        raise RuntimeError(f"{where}: sliding window {kwargs.get('sliding_window')} != built {layer.sliding_window}")
    if kwargs.get("softcap") != layer.logit_softcap:
        raise RuntimeError(f"{where}: soft-cap {kwargs.get('softcap')} != built {layer.logit_softcap}")
    if kwargs.get("s_aux") is not None:
        raise RuntimeError(f"{where}: attention sinks (s_aux) are not run by the transformers backend")


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """transformers' attention modules of `model` by layer index: `*Attention` modules with an int `layer_idx`."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if type(module).__name__.endswith("Attention") and isinstance(idx, int) and not isinstance(idx, bool):
            if idx in found:
                raise ValueError(f"two attention modules claim layer_idx {idx}: {type(found[idx]).__name__}, "
                                 f"{type(module).__name__}")
            found[idx] = module
    return found


def make_attention_layers(model: nn.Module, config: PretrainedConfig, tp_size: int) -> nn.ModuleList:
    """One llmplug `Attention` per attention module of `model`, in layer order, with this rank's heads."""
    modules = attention_modules(model)
    if sorted(modules) != list(range(len(modules))) or not modules:
        raise ValueError(f"{type(model).__name__}: attention modules' layer_idx {sorted(modules)} are not 0..n-1")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("KV heads", kv_heads)):
        if count % tp_size:
            raise ValueError(f"{count} {what} cannot be split over tensor_parallel_size={tp_size}")
    layers = [_layer(i, modules[i], config, heads // tp_size, kv_heads // tp_size) for i in range(len(modules))]
    return nn.ModuleList(layers)


def _layer(index: int, module: nn.Module, config: PretrainedConfig, heads: int, kv_heads: int) -> Attention:
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    return Attention(
        heads,
        head_dim,
        float(getattr(module, "scaling", head_dim**-0.5)),
        kv_heads,
        prefix=f"{LAYERS_KWARG}.{index}",
        sliding_window=_sliding_window(module),
        logit_softcap=getattr(module, "attn_logit_softcapping", None),
        causal=bool(getattr(module, "is_causal", True)),
    )


def _sliding_window(module: nn.Module) -> int | None:
    """The window the module passes to attention: its own attribute (per layer type), else its config's where its
    forward passes that (Mistral and Mixtral keep no attribute; Moshi has a config window it does not pass)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window or None
    try:
        passes_config_window = "sliding_window=getattr(self.config" in inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # no source to read: the per-call check still catches a window it passes
        passes_config_window = False
    return (getattr(module.config, "sliding_window", None) or None) if passes_config_window else None
