"""Readers of Hugging Face configs shared by the family adapters.

An adapter (`gemma_arch_config(hf) -> DecoderArchConfig`, ...) is the only code that reads a HF
config; these helpers read the fields most families share: sizes, rope settings (transformers 5
`rope_parameters`, flat or keyed by layer type, or transformers 4 `rope_theta` + `rope_scaling`),
per-layer attention windows and NoPE layers. The typed config itself lives in
`llmplug.layers.decoder` (re-exported here).
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any, Callable, Collection, Mapping

from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError
from llmplug.layers.decoder.arch import DecoderArchConfig, LayerConfig, MLPConfig, RopeConfig

__all__ = [
    "SLIDING",
    "DecoderArchConfig",
    "LayerConfig",
    "MLPConfig",
    "RopeConfig",
    "architecture_of",
    "head_dim_of",
    "layers_of",
    "moe_layers",
    "refuse",
    "rope_config_of",
    "sizes_of",
]

SLIDING = "sliding_attention"  # the layer type of windowed layers in `layer_types`


def architecture_of(hf: PretrainedConfig) -> str:
    """The config's first `architectures` entry (its class name when it lists none)."""
    return (getattr(hf, "architectures", None) or [type(hf).__name__])[0]


def refuse(hf: PretrainedConfig, condition: bool, what: str) -> None:
    """ModelLoadError naming the architecture when `condition` holds: `what` is not supported."""
    if condition:
        raise ModelLoadError(f"{architecture_of(hf)}: {what} is not supported")


def head_dim_of(hf: PretrainedConfig) -> int:
    """The config's head_dim when set, else hidden_size / num_attention_heads."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def sizes_of(hf: PretrainedConfig, intermediate_size: int | None = None) -> dict[str, Any]:
    """The size fields of DecoderArchConfig from transformers' standard names (and attribute maps)."""
    return dict(
        architecture=architecture_of(hf),
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=intermediate_size or hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim_of(hf),
    )


def _rope_parameters(hf: PretrainedConfig) -> dict[str, Any]:
    """transformers 5 `rope_parameters`, else transformers 4 `rope_scaling` + `rope_theta` (a copy)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)
    return params


def _is_per_layer_type(params: Mapping[str, Any]) -> bool:
    return any(isinstance(v, Mapping) for v in params.values())


def rope_config_of(
    hf: PretrainedConfig,
    params: Mapping[str, Any] | None = None,
    *,
    is_neox_style: bool = True,
    partial_rotary_factor: float | None = None,
) -> RopeConfig:
    """A RopeConfig from one rope-parameters dict (default: the config's own, which must not be per layer type)."""
    params = dict(_rope_parameters(hf) if params is None else params)
    if _is_per_layer_type(params):
        raise ModelLoadError(
            f"{architecture_of(hf)}: rope parameters are per layer type {sorted(params)}; read them with layers_of"
        )
    theta = float(params.pop("rope_theta", None) or 10000.0)
    mrope_section = params.pop("mrope_section", None)
    if params.pop("mrope_interleaved", False):  # Qwen3-VL's layout, not built: a text family's positions are [T]
        mrope_section = None  # (the same on every stream), which plain RoPE rotates exactly alike
    partial = params.pop("partial_rotary_factor", None) or getattr(hf, "partial_rotary_factor", None)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    scaling = MappingProxyType(params) if rope_type != "default" else None
    factor = float(partial_rotary_factor or partial or 1.0)
    mrope = tuple(int(n) for n in mrope_section) if mrope_section else None
    return RopeConfig(theta, hf.max_position_embeddings, scaling, factor, is_neox_style, mrope_section=mrope)


def layers_of(
    hf: PretrainedConfig,
    *,
    rope: bool = True,
    is_neox_style: bool = True,
    partial_rotary_factor: float | None = None,
    nope_layers: Collection[int] = (),
    window: int | None = None,
) -> tuple[LayerConfig, ...]:
    """One LayerConfig per layer from `layer_types`, `sliding_window` and the rope parameters.

    Without `layer_types`, a set `sliding_window` (or `window`) applies to every layer, as
    transformers' Mistral does. Rope parameters keyed by layer type give each layer its type's rope.
    `rope=False`: no rotary anywhere (absolute positions or ALiBi); `nope_layers`: layers without it.
    """
    n = hf.num_hidden_layers
    window = window or getattr(hf, "sliding_window", None)
    types = list(getattr(hf, "layer_types", None) or [SLIDING if window else "full_attention"] * n)
    if len(types) != n:
        raise ModelLoadError(f"{architecture_of(hf)}: {len(types)} layer_types for {n} layers")
    ropes = _ropes_by_type(hf, set(types), is_neox_style, partial_rotary_factor) if rope else {}
    return tuple(
        LayerConfig(None if i in nope_layers else ropes.get(kind), window if kind == SLIDING else None)
        for i, kind in enumerate(types)
    )


def _ropes_by_type(
    hf: PretrainedConfig, types: set[str], is_neox_style: bool, partial: float | None
) -> dict[str, RopeConfig]:
    params = _rope_parameters(hf)
    if not _is_per_layer_type(params):
        one = rope_config_of(hf, params, is_neox_style=is_neox_style, partial_rotary_factor=partial)
        return dict.fromkeys(types, one)
    missing = types - set(params)
    if missing:
        raise ModelLoadError(f"{architecture_of(hf)}: rope_parameters has no entry for layer types {sorted(missing)}")
    return {
        kind: rope_config_of(hf, params[kind], is_neox_style=is_neox_style, partial_rotary_factor=partial)
        for kind in types
    }


def moe_layers(layers: tuple[LayerConfig, ...], is_moe: Callable[[int], bool] = lambda i: True) -> tuple[LayerConfig, ...]:
    """`layers` with the mixture of experts on every layer index `is_moe` accepts (default: all)."""
    return tuple(replace(layer, moe=is_moe(i)) for i, layer in enumerate(layers))
