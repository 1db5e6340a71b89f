"""A family's checkpoint layout, declared as data, and its translation into a model's parameter names.

Families name the same tensors differently (`transformer.h.0.attn.c_attn` in GPT-2,
`gpt_neox.layers.0.attention.query_key_value` in GPT-NeoX, `model.layers.0.self_attn.q_proj` in
Llama) and some store several projections as one tensor. A `CheckpointNames` says, per family:

- `prefixes`: leading paths of the checkpoint -> the model's, matched from the first component
  (`"transformer.h": "model.layers"`; the longest match wins, applied once); the place for names that
  mean different modules at different depths (OPT's top-level and per-layer `final_layer_norm`) and
  for checkpoints saved with and without a base-model prefix (list both);
- `renames`: dotted paths -> paths of the model, matched on whole components anywhere after the
  prefix step (`"attn.c_attn": "self_attn.qkv_proj"` renames `h.0.attn.c_attn.weight`, never
  `xattn.c_attn`);
- `transposed`: modules (model names) whose checkpoint weights are stored [in, out] (GPT-2's Conv1D);
- `fused`: modules (model names) whose checkpoint tensor holds several projections, with its layout
  (`QKV_*`, `GATE_UP`, `UP_GATE`); the tensor is split into the parts' own names (`q_proj`, `k_proj`, `v_proj`,
  `gate_proj`, `up_proj`), which the model's stacked-parameter map then loads into its fused layers;
- `ignored`: checkpoint name suffixes the model knowingly drops (e.g. GPT-2's causal-mask buffers).

`translate(weights, heads)` applies all of it lazily, tensor by tensor; the generic loading loop
(`load_mapped_weights`) does the rest. No name is guessed: whatever the declaration does not cover
reaches the loop unchanged and is an error there if the model has no such parameter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

import torch

from llmplug.core.errors import ModelLoadError

__all__ = [
    "GATE_UP",
    "QKV_CONTIGUOUS",
    "QKV_GROUPED",
    "QKV_PER_HEAD",
    "UP_GATE",
    "CheckpointNames",
    "HeadLayout",
]

# fused layouts: how one checkpoint tensor (rows along dim 0) holds several projections
QKV_CONTIGUOUS = "qkv_contiguous"  # [q heads | k heads | v heads] (Phi-3, GPT-2, MPT, Falcon multi-query)
QKV_PER_HEAD = "qkv_per_head"  # [heads, (q, k, v), head_dim] (GPT-NeoX, Bloom, Falcon)
QKV_GROUPED = "qkv_grouped"  # [kv_heads, (q of the group..., k, v), head_dim] (Falcon's new decoder)
GATE_UP = "gate_up"  # [gate | up] (Phi-3)
UP_GATE = "up_gate"  # [up | gate] (GTE)


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """Head counts that a fused q/k/v tensor is split by."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def _split_qkv_contiguous(t: torch.Tensor, h: HeadLayout) -> list[torch.Tensor]:
    q, kv = h.num_heads * h.head_dim, h.num_kv_heads * h.head_dim
    return list(t.split([q, kv, kv], dim=0))


def _split_qkv_per_head(t: torch.Tensor, h: HeadLayout) -> list[torch.Tensor]:
    if h.num_heads != h.num_kv_heads:
        raise ModelLoadError(f"a per-head interleaved q/k/v tensor needs as many KV heads as heads, got {h}")
    parts = t.unflatten(0, (h.num_heads, 3, h.head_dim))  # [heads, 3, head_dim, ...]
    return [parts[:, i].flatten(0, 1) for i in range(3)]


def _split_qkv_grouped(t: torch.Tensor, h: HeadLayout) -> list[torch.Tensor]:
    group = h.num_heads // h.num_kv_heads
    parts = t.unflatten(0, (h.num_kv_heads, group + 2, h.head_dim))  # [kv_heads, group + 2, head_dim, ...]
    q, k, v = parts[:, :group], parts[:, group], parts[:, group + 1]
    return [q.flatten(0, 2), k.flatten(0, 1), v.flatten(0, 1)]


def _split_halves(t: torch.Tensor, h: HeadLayout) -> list[torch.Tensor]:
    return list(t.chunk(2, dim=0))


_QKV_PARTS = ("q_proj", "k_proj", "v_proj")
# layout -> (the parts' module names, the split)
_LAYOUTS: dict[str, tuple[tuple[str, ...], Callable[[torch.Tensor, HeadLayout], list[torch.Tensor]]]] = {
    QKV_CONTIGUOUS: (_QKV_PARTS, _split_qkv_contiguous),
    QKV_PER_HEAD: (_QKV_PARTS, _split_qkv_per_head),
    QKV_GROUPED: (_QKV_PARTS, _split_qkv_grouped),
    GATE_UP: (("gate_proj", "up_proj"), _split_halves),
    UP_GATE: (("up_proj", "gate_proj"), _split_halves),
}


@dataclass(frozen=True)
class CheckpointNames:
    """How a family's checkpoint names and layouts map onto the model's parameters (see the module doc)."""

    prefixes: Mapping[str, str] = field(default_factory=dict)
    renames: Mapping[str, str] = field(default_factory=dict)
    transposed: frozenset[str] = frozenset()
    fused: Mapping[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = {name: layout for name, layout in self.fused.items() if layout not in _LAYOUTS}
        if unknown:
            raise ValueError(f"unknown fused layouts {unknown}; known: {sorted(_LAYOUTS)}")

    @functools.cached_property
    def _prefix_rules(self) -> tuple[tuple[list[str], str], ...]:
        return _longest_first(self.prefixes)

    @functools.cached_property
    def _rules(self) -> tuple[tuple[list[str], str], ...]:
        return _longest_first(self.renames)

    def rename(self, name: str) -> str:
        """The model's name for checkpoint tensor `name`: its prefix, then each component renamed at most once."""
        parts = name.split(".")
        for source, target in self._prefix_rules:
            if parts[: len(source)] == source:
                parts = [*target.split("."), *parts[len(source) :]]
                break
        out, i = [], 0
        while i < len(parts):
            for source, target in self._rules:
                if parts[i : i + len(source)] == source:
                    out.append(target)
                    i += len(source)
                    break
            else:
                out.append(parts[i])
                i += 1
        return ".".join(out)

    def translate(
        self, weights: Iterable[tuple[str, torch.Tensor]], heads: HeadLayout
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) -> (model name, tensor), fused tensors split into their parts."""
        for name, tensor in weights:
            if _has_suffix(name, self.ignored):
                continue
            name = self.rename(name)
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and _has_suffix(module, self.transposed):
                tensor = tensor.t()
            layout = _matching(module, self.fused)
            if layout is None:
                yield name, tensor
                continue
            part_names, split = _LAYOUTS[layout]
            owner = module.rpartition(".")[0]
            for part, piece in zip(part_names, split(tensor, heads)):
                yield _join(owner, part, leaf), piece


def _longest_first(rules: Mapping[str, str]) -> tuple[tuple[list[str], str], ...]:
    """Rules as (source components, target), longest source first: "attn.c_proj" wins over "c_proj"."""
    return tuple(sorted(((k.split("."), v) for k, v in rules.items()), key=lambda r: -len(r[0])))


def _has_suffix(name: str, suffixes: Iterable[str]) -> bool:
    """True when `name` ends with one of `suffixes` at a dot boundary."""
    return any(name == s or name.endswith("." + s) for s in suffixes)


def _matching(module: str, fused: Mapping[str, str]) -> str | None:
    """The layout of the first `fused` entry `module` ends with (at a dot boundary), else None."""
    for suffix, layout in fused.items():
        if _has_suffix(module, (suffix,)):
            return layout
    return None


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)
