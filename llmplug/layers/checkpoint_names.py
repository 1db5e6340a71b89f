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
  the `EXPERTS*` layouts split a tensor stacking every expert of a mixture-of-experts layer
  (`experts.gate_up_proj`, `experts.down_proj`, ...) into per-expert tensors `experts.<e>.gate_proj`,
  `experts.<e>.up_proj`, `experts.<e>.down_proj` (views, no copies), which load like a checkpoint
  that stores them one by one;
- `stacked`: modules the checkpoint stores as one tensor per index (`q_layernorm.norms.{h}`, StableLM 2's
  per-head norms), gathered in index order into one tensor of the model's module (`q_norm`, [heads, ...]);
- `ignored`: checkpoint name suffixes the model knowingly drops (e.g. GPT-2's causal-mask buffers);
  `ignored_prefixes`: leading paths it knowingly drops, whole components (e.g. the multi-token-prediction
  layer DeepSeek V3 checkpoints store after the model's own layers).

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
    "EXPERTS",
    "EXPERTS_FLAT",
    "EXPERTS_FLAT_T",
    "EXPERTS_T",
    "EXPERTS_T_INTERLEAVED",
    "GATE_UP",
    "QKV_CODEGEN",
    "QKV_CONTIGUOUS",
    "QKV_GROUPED",
    "QKV_PER_HEAD",
    "STACKED_EXPERT_LEAVES",
    "UP_GATE",
    "CheckpointNames",
    "HeadLayout",
]

# fused layouts: how one checkpoint tensor (rows along dim 0) holds several projections
QKV_CONTIGUOUS = "qkv_contiguous"  # [q heads | k heads | v heads] (Phi-3, GPT-2, MPT, Falcon multi-query)
QKV_PER_HEAD = "qkv_per_head"  # [heads, (q, k, v), head_dim] (GPT-NeoX, Bloom, Falcon)
QKV_GROUPED = "qkv_grouped"  # [kv_heads, (q of the group..., k, v), head_dim] (Falcon's new decoder)
QKV_CODEGEN = "qkv_codegen"  # [4 blocks, (q, v, k), heads / 4 * head_dim] (CodeGen's mp_num = 4 layout)
GATE_UP = "gate_up"  # [gate | up] (Phi-3)
CODEGEN_BLOCKS = 4  # CodeGen's `mp_num`, fixed in its code
UP_GATE = "up_gate"  # [up | gate] (GTE)
# stacked experts (module `...experts.<name>`; `gate_up_proj` holds [gate | up] along its output dim)
EXPERTS = "experts"  # [E, out, in] (GraniteMoe, JetMoe)
EXPERTS_T = "experts_t"  # [E, in, out] (Llama 4, GPT-OSS down_proj)
EXPERTS_T_INTERLEAVED = "experts_t_interleaved"  # [E, in, 2 * out], gate and up columns alternating (GPT-OSS)
EXPERTS_FLAT = "experts_flat"  # [E * out, in] (DBRX w1, v1)
EXPERTS_FLAT_T = "experts_flat_t"  # [E * in, out] (DBRX w2)
# renames giving transformers' stacked expert parameters (`experts.gate_up_proj`, `experts.down_proj`, their
# `_bias`; saved so by families without a per-expert checkpoint format) the `.weight` / `.bias` leaf of a module
STACKED_EXPERT_LEAVES: Mapping[str, str] = {
    "experts.gate_up_proj": "experts.gate_up_proj.weight",
    "experts.down_proj": "experts.down_proj.weight",
    "experts.gate_up_proj_bias": "experts.gate_up_proj.bias",
    "experts.down_proj_bias": "experts.down_proj.bias",
}


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """Head counts that a fused q/k/v tensor is split by (and the expert count of stacked experts)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0  # experts of a mixture-of-experts layer (the EXPERTS_FLAT layouts need it)


Parts = list[tuple[str, torch.Tensor]]  # (the part's module name relative to the fused one's owner, tensor)


def _split_qkv_contiguous(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    q, kv = h.num_heads * h.head_dim, h.num_kv_heads * h.head_dim
    return list(zip(_QKV_PARTS, t.split([q, kv, kv], dim=0)))


def _split_qkv_per_head(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    if h.num_heads != h.num_kv_heads:
        raise ModelLoadError(f"a per-head interleaved q/k/v tensor needs as many KV heads as heads, got {h}")
    parts = t.unflatten(0, (h.num_heads, 3, h.head_dim))  # [heads, 3, head_dim, ...]
    return [(part, parts[:, i].flatten(0, 1)) for i, part in enumerate(_QKV_PARTS)]


def _split_qkv_grouped(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    group = h.num_heads // h.num_kv_heads
    parts = t.unflatten(0, (h.num_kv_heads, group + 2, h.head_dim))  # [kv_heads, group + 2, head_dim, ...]
    q, k, v = parts[:, :group], parts[:, group], parts[:, group + 1]
    return list(zip(_QKV_PARTS, [q.flatten(0, 2), k.flatten(0, 1), v.flatten(0, 1)]))


def _split_qkv_codegen(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    if h.num_heads != h.num_kv_heads or h.num_heads % CODEGEN_BLOCKS:
        raise ModelLoadError(f"CodeGen's q/k/v tensor needs as many KV heads as heads, a multiple of 4, got {h}")
    parts = t.unflatten(0, (CODEGEN_BLOCKS, 3, -1))  # [4, (q, v, k), heads / 4 * head_dim, ...]
    return list(zip(_QKV_PARTS, [parts[:, i].flatten(0, 1) for i in (0, 2, 1)]))


def _split_halves(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    return list(zip(("gate_proj", "up_proj"), t.chunk(2, dim=0)))


def _split_up_gate(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    return list(zip(("up_proj", "gate_proj"), t.chunk(2, dim=0)))


def _per_expert(stacked: torch.Tensor, name: str, interleaved: bool = False) -> Parts:
    """stacked [E, out, (in)] (Linear orientation, a bias without `in`) -> `<e>.<proj>` pieces; a
    `gate_up_proj` is cut into gate_proj and up_proj, its halves or (interleaved) its alternate rows."""
    if name != "gate_up_proj":
        return [(f"{e}.{name}", stacked[e]) for e in range(stacked.shape[0])]
    gate, up = (stacked[:, 0::2], stacked[:, 1::2]) if interleaved else stacked.chunk(2, dim=1)
    pairs = (("gate_proj", gate), ("up_proj", up))
    return [(f"{e}.{proj}", part[e]) for e in range(stacked.shape[0]) for proj, part in pairs]


def _t(t: torch.Tensor) -> torch.Tensor:
    """[E, in, out] -> [E, out, in]; a stacked bias [E, out] as it is."""
    return t.transpose(1, 2) if t.dim() == 3 else t


def _split_experts(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    return _per_expert(t, name)


def _split_experts_t(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    return _per_expert(_t(t), name)


def _split_experts_t_interleaved(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    return _per_expert(_t(t), name, interleaved=True)


def _split_experts_flat(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    return _per_expert(t.unflatten(0, (_num_experts(h), -1)), name)


def _split_experts_flat_t(t: torch.Tensor, h: HeadLayout, name: str) -> Parts:
    return _per_expert(_t(t.unflatten(0, (_num_experts(h), -1))), name)


def _num_experts(h: HeadLayout) -> int:
    if h.num_experts < 1:
        raise ModelLoadError("a flat stacked-experts tensor needs the model's expert count (HeadLayout.num_experts)")
    return h.num_experts


_QKV_PARTS = ("q_proj", "k_proj", "v_proj")
# layout -> how a tensor of it splits into named parts
_LAYOUTS: dict[str, Callable[[torch.Tensor, HeadLayout, str], Parts]] = {
    QKV_CONTIGUOUS: _split_qkv_contiguous,
    QKV_PER_HEAD: _split_qkv_per_head,
    QKV_GROUPED: _split_qkv_grouped,
    QKV_CODEGEN: _split_qkv_codegen,
    GATE_UP: _split_halves,
    UP_GATE: _split_up_gate,
    EXPERTS: _split_experts,
    EXPERTS_T: _split_experts_t,
    EXPERTS_T_INTERLEAVED: _split_experts_t_interleaved,
    EXPERTS_FLAT: _split_experts_flat,
    EXPERTS_FLAT_T: _split_experts_flat_t,
}


@dataclass(frozen=True)
class CheckpointNames:
    """How a family's checkpoint names and layouts map onto the model's parameters (see the module doc)."""

    prefixes: Mapping[str, str] = field(default_factory=dict)
    renames: Mapping[str, str] = field(default_factory=dict)
    transposed: frozenset[str] = frozenset()
    fused: Mapping[str, str] = field(default_factory=dict)
    stacked: Mapping[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    ignored_prefixes: tuple[str, ...] = ()

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
        """(checkpoint name, tensor) -> (model name, tensor), fused tensors split into their parts, stacked
        pieces gathered (yielded once all other tensors are)."""
        pieces: dict[str, dict[int, torch.Tensor]] = {}
        for name, tensor in weights:
            if _has_suffix(name, self.ignored) or _has_prefix(name, self.ignored_prefixes):
                continue
            name = self.rename(name)
            piece = self._stacked_piece(name)
            if piece is not None:
                pieces.setdefault(piece[0], {})[piece[1]] = tensor
                continue
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and _has_suffix(module, self.transposed):
                tensor = tensor.t()
            layout = _matching(module, self.fused)
            if layout is None:
                yield name, tensor
                continue
            owner, _, own_name = module.rpartition(".")
            for part, piece in _LAYOUTS[layout](tensor, heads, own_name):
                yield _join(owner, part, leaf), piece
        for name, by_index in pieces.items():
            if sorted(by_index) != list(range(len(by_index))):
                raise ModelLoadError(f"{name}: the checkpoint has pieces {sorted(by_index)}, not 0..{len(by_index) - 1}")
            yield name, torch.stack([by_index[i] for i in range(len(by_index))])

    def _stacked_piece(self, name: str) -> tuple[str, int] | None:
        """(the model's name, index) of a tensor that is one piece of a `stacked` module, else None."""
        parts = name.split(".")
        for source, target in self.stacked.items():
            src = source.split(".")
            for i in range(len(parts) - len(src)):
                index = parts[i + len(src)]
                if parts[i : i + len(src)] == src and index.isdigit():
                    return ".".join([*parts[:i], target, *parts[i + len(src) + 1 :]]), int(index)
        return None


def _longest_first(rules: Mapping[str, str]) -> tuple[tuple[list[str], str], ...]:
    """Rules as (source components, target), longest source first: "attn.c_proj" wins over "c_proj"."""
    return tuple(sorted(((k.split("."), v) for k, v in rules.items()), key=lambda r: -len(r[0])))


def _has_suffix(name: str, suffixes: Iterable[str]) -> bool:
    """True when `name` ends with one of `suffixes` at a dot boundary."""
    return any(name == s or name.endswith("." + s) for s in suffixes)


def _has_prefix(name: str, prefixes: Iterable[str]) -> bool:
    """True when `name` starts with one of `prefixes` at a dot boundary."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _matching(module: str, fused: Mapping[str, str]) -> str | None:
    """The layout of the first `fused` entry `module` ends with (at a dot boundary), else None."""
    for suffix, layout in fused.items():
        if _has_suffix(module, (suffix,)):
            return layout
    return None


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)
