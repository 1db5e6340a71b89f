"""Rotary position embeddings (RoPE) with the scaling variants transformers implements.

`get_rope` computes the inverse frequencies exactly as `transformers.modeling_rope_utils` does and
precomputes a [max_position, rotary_dim] cos|sin table (float32 buffer). A model looks the table
up once per step (`cos_sin(positions, dtype)`) and every layer rotates its q and k in place with
the result's `apply_`.

Dynamic NTK scaling in transformers rescales the base from the current sequence length of the
batch, which a paged cache cannot follow (cached keys keep the rotation they were written with).
Here row p of the table uses the base transformers computes for a sequence of length p + 1: within
`max_position_embeddings` that is plain RoPE (identical to transformers), beyond it each token is
rotated as transformers rotates it when it decodes that token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from llmplug.layers.kernels import use_triton
from llmplug.layers.kernels.native import ops, use_native

__all__ = ["RotaryCosSin", "RotaryEmbedding", "RotaryPositions", "get_rope", "rope_inv_freq"]


@dataclass(slots=True, frozen=True)
class RotaryCosSin:
    """One step's rotation, looked up once and shared by every layer."""

    cos: torch.Tensor  # [T, 1, rotary_dim]  cos of each frequency, laid out like the rotated dims
    sin: torch.Tensor  # [T, 1, rotary_dim]  sin with the sign of the rotation formula folded in
    is_neox_style: bool = True

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, num_heads, head_size] in place (any head count: q and k together); returns x."""
        if x.dim() == 3 and x.stride(-1) == 1 and use_native(x):  # one kernel call, the bits of the ops below
            ops().rotary_embedding(x, self.cos, self.sin, self.is_neox_style)
            return x
        rotary_dim = self.cos.shape[-1]
        rot = x if rotary_dim == x.shape[-1] else x[..., :rotary_dim]
        partner = self._partner(rot)  # copied before rot is overwritten
        rot.mul_(self.cos).addcmul_(partner, self.sin)
        return x

    def _partner(self, rot: torch.Tensor) -> torch.Tensor:
        """Each dim's rotation partner: [x2, x1] for rotate-half, [x1, x0, x3, x2, ...] interleaved (a copy)."""
        if self.is_neox_style:
            return rot.roll(rot.shape[-1] // 2, dims=-1)
        return rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


@dataclass(slots=True, frozen=True)
class RotaryPositions:
    """One step's rotation for the Triton kernel, which reads the table itself: nothing is precomputed."""

    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim] float32: cos | sin
    is_neox_style: bool = True

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, num_heads, head_size] in place (any head count: q and k together); returns x."""
        from llmplug.layers.kernels.rotary import rotary_embedding_

        return rotary_embedding_(x, self.positions, self.cos_sin_cache, self.is_neox_style)


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """[dim / 2] inverse frequencies base^(-2i / dim), in float32 as transformers computes them."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def _linear(base: float, dim: int, scaling: Mapping[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """Position interpolation: frequencies divided by `factor`."""
    return default_inv_freq(base, dim) / scaling["factor"], 1.0


def _llama3(base: float, dim: int, scaling: Mapping[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1: low frequencies divided by `factor`, high kept, a smooth ramp between."""
    inv_freq = default_inv_freq(base, dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(scaling: Mapping[str, Any], factor: float) -> float:
    """cos/sin multiplier: explicit `attention_factor`, else from mscale / mscale_all_dim, else from factor."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_correction_range(scaling: Mapping[str, Any], base: float, dim: int) -> tuple[float, float]:
    """The band of dimensions that ramps from extrapolation to interpolation."""
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(base: float, dim: int, scaling: Mapping[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: per-dimension blend of interpolated and extrapolated frequencies, plus a cos/sin scale."""
    factor = scaling.get("factor") or max_position / scaling["original_max_position_embeddings"]
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(scaling, base, dim)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, _yarn_attention_factor(scaling, factor)


def _longrope(base: float, dim: int, scaling: Mapping[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 128k): frequencies divided per dimension by `long_factor` when the model's context
    (`max_position`) exceeds `original_max_position_embeddings`, else by `short_factor`; cos/sin scaled.

    transformers switches the set per forward call by the sequence's length, which a paged cache cannot
    follow (cached keys keep their rotation); like vLLM at its default max_model_len, the set is chosen
    once for the model, so a sequence longer than the original context matches transformers exactly.
    """
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(scaling["long_factor" if max_position > original else "short_factor"])
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors.float() * base**exponents), float(attention_factor)


_INV_FREQ = {"linear": _linear, "llama3": _llama3, "yarn": _yarn, "longrope": _longrope}


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    """The scaling type of a rope_scaling / rope_parameters dict ("default" when absent)."""
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def rope_inv_freq(
    base: float, dim: int, scaling: Mapping[str, Any] | None = None, max_position: int = 2048
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] and cos/sin scale of a (non-dynamic) rope type."""
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return default_inv_freq(base, dim), 1.0
    if rope_type not in _INV_FREQ:
        known = ["default", "dynamic", *_INV_FREQ]
        raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: {known}")
    return _INV_FREQ[rope_type](base, dim, scaling, max_position)


def _dynamic_ntk_freqs(base: float, dim: int, factor: float, max_position: int, length: int) -> torch.Tensor:
    """[length, dim / 2] angles of dynamic NTK: position p uses the base for a sequence of p + 1 tokens."""
    positions = torch.arange(length, dtype=torch.float32)
    seq_len = torch.clamp(positions + 1, min=max_position).to(torch.float64)
    bases = base * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (bases.to(torch.float32)[:, None] ** exponents[None, :])  # [length, dim / 2]
    return positions[:, None] * inv_freq


def _table_length(rope_type: str, scaling: Mapping[str, Any] | None, max_position: int) -> int:
    """Positions the cos/sin table covers: the scaled context length where the scaling extends it."""
    if rope_type in ("linear", "dynamic"):
        return int(max_position * scaling["factor"])
    if rope_type == "yarn" and scaling.get("factor"):
        return max(max_position, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return max_position


def build_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float, scaling: Mapping[str, Any] | None, inverted: bool = False
) -> torch.Tensor:
    """[length, rotary_dim] float32: cos of the rotary_dim / 2 angles, then their sin (of minus the angles
    when `inverted`: the rotation goes the other way, as NanoChat's flipped `rotate_half`)."""
    rope_type = rope_type_of(scaling)
    length = _table_length(rope_type, scaling, max_position)
    if rope_type == "dynamic":
        freqs, attention_factor = _dynamic_ntk_freqs(base, rotary_dim, scaling["factor"], max_position, length), 1.0
    else:
        inv_freq, attention_factor = rope_inv_freq(base, rotary_dim, scaling, max_position)
        freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [length, dim / 2]
    sin = -freqs.sin() if inverted else freqs.sin()
    return torch.cat((freqs.cos(), sin), dim=-1) * attention_factor


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` dims of each head by position-dependent angles."""

    def __init__(
        self, head_size: int, rotary_dim: int, cos_sin_cache: torch.Tensor, is_neox_style: bool = True
    ) -> None:
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, is_neox_style
        # a real buffer (not persistent: recomputed from the config, never read from checkpoints)
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)  # [max_position, rotary_dim]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryCosSin | RotaryPositions:
        """Look up one step's rotation for `positions` [T], in the activations' dtype (a GPU's Triton
        kernel looks the angles up itself: `use_triton`)."""
        if use_triton(positions):
            return RotaryPositions(positions, self.cos_sin_cache, self.is_neox_style)
        return self.rotation(self.cos_sin_cache.index_select(0, positions), dtype)  # rows [T, rotary_dim]

    def rotation(self, rows: torch.Tensor, dtype: torch.dtype) -> RotaryCosSin:
        """The rotation of each token from its row [T, rotary_dim] (cos | sin) of the table, in `dtype`."""
        half = self.rotary_dim // 2
        cos, sin = rows[:, :half], rows[:, half:]
        if self.is_neox_style:  # rotate-half layout: dims i and i + half form a pair
            full_cos, signed_sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        else:  # interleaved layout: dims 2i and 2i + 1 form a pair
            full_cos = cos.repeat_interleave(2, dim=-1)
            signed_sin = torch.stack((-sin, sin), dim=-1).flatten(-2)
        return RotaryCosSin(full_cos.to(dtype).unsqueeze(1), signed_sin.to(dtype).unsqueeze(1), self.is_neox_style)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of query [T, H * D] and key [T, Hkv * D] (the inputs are left unchanged)."""
        cs = self.cos_sin(positions, query.dtype)
        num_tokens = positions.shape[0]
        q = cs.apply_(query.reshape(num_tokens, -1, self.head_size).clone())
        k = cs.apply_(key.reshape(num_tokens, -1, self.head_size).clone())
        return q.view_as(query), k.view_as(key)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.cos_sin_cache.shape[0]}"


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Mapping[str, Any] | None = None,
    is_neox_style: bool = True,
    inverted: bool = False,
) -> RotaryEmbedding:
    """A RotaryEmbedding for `rope_scaling` (transformers' rope_scaling / rope_parameters dict, or None).

    Supported types: default, linear, dynamic (NTK), llama3, yarn, longrope. `max_position` is the config's
    max_position_embeddings; `inverted` rotates by minus the angles.
    """
    cache = build_cos_sin_cache(rotary_dim, max_position, float(base), rope_scaling, inverted)
    return RotaryEmbedding(head_size, rotary_dim, cache, is_neox_style)
