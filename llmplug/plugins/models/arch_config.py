"""Typed, frozen architecture configs, converted once from a Hugging Face config.

Models never probe the HF config: an adapter function per architecture reads it once (this module
holds the shared readers) and the model sees only these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError

__all__ = ["DecoderArchConfig", "RopeConfig", "head_dim_of", "rope_config_of", "sliding_windows_of"]


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of a model."""

    theta: float
    max_position: int  # max_position_embeddings of the config
    scaling: Mapping[str, Any] | None = None  # rope_scaling / rope_parameters without rope_theta; None: plain RoPE
    partial_rotary_factor: float = 1.0
    is_neox_style: bool = True  # rotate-half pairs (i, i + d/2), as transformers' Llama family


@dataclass(frozen=True, slots=True)
class DecoderArchConfig:
    """A pre-norm decoder with RMSNorm, RoPE, grouped-query attention and a gated-SiLU MLP."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q, k, v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rotary (Qwen3)
    sliding_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full); (): none

    def sliding_window_of(self, layer_index: int) -> int | None:
        """The sliding window of layer `layer_index`, None for full attention."""
        return self.sliding_windows[layer_index] if self.sliding_windows else None

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that are rotated."""
        return int(self.head_dim * self.rope.partial_rotary_factor)


def head_dim_of(hf: PretrainedConfig) -> int:
    """The config's head_dim when set, else hidden_size / num_attention_heads."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def sliding_windows_of(hf: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window: `sliding_window` on the layers `layer_types` marks "sliding_attention"
    (Qwen2/3 derive them from use_sliding_window and max_window_layers), or on every layer when the
    config has no layer_types (Mistral); () when the config sets no window."""
    window = getattr(hf, "sliding_window", None)
    if not window:
        return ()
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _rope_dict(hf: PretrainedConfig) -> dict[str, Any]:
    """Rope settings from transformers 5 `rope_parameters` or transformers 4 `rope_theta` + `rope_scaling`."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ModelLoadError(f"per-layer-type rope parameters {sorted(params)} are not supported by this model")
    return params


def rope_config_of(hf: PretrainedConfig) -> RopeConfig:
    """The rotary settings of a Llama-family HF config (either transformers generation)."""
    params = _rope_dict(hf)
    theta = float(params.pop("rope_theta", 10000.0))
    partial = float(params.pop("partial_rotary_factor", None) or getattr(hf, "partial_rotary_factor", 1.0) or 1.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    scaling = MappingProxyType(params) if rope_type != "default" else None
    return RopeConfig(theta, hf.max_position_embeddings, scaling, partial)
