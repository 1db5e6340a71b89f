"""The adapter slots of one linear layer and the batched LoRA compute over a flattened batch.

Each LoRA-capable linear layer gets a `LoRASlots`: `max_loras` device slots, each holding one
adapter's A and B for this layer, padded to `max_lora_rank` and zero where the adapter does not adapt
the layer. A fused layer of n parts (q/k/v: 3, gate/up: 2) stacks its parts' A along the rank and
keeps B block-diagonal, so one shrink and one expand serve all parts:

    shrink = x @ A[:U]^T          A: [max_loras * n * R, in]   slots side by side
    y     += (shrink * mask) @ B[:, :U]^T    B: [out, max_loras * n * R]

`mask` ([T, U], one-hot) zeroes the columns of every slot but the token's own, so each token gets its
own adapter's delta (exactly: the other slots contribute exact zeros) with two matmuls for the whole
batch and no loop over requests or slots. U is one past the highest slot the step uses (the manager
fills the lowest free slots first), and both slices are views: no weight is copied per step. The work
grows with U * n * R extra columns, not with the batch.

Under tensor parallelism the slots are sharded like the base weight, with the layer's own `_place`:
a column-parallel layer keeps A whole and its rows of B; a row-parallel layer keeps its columns of A
and B whole, and its partial deltas are summed by the layer's all-reduce with the base output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from llmplug.layers.forward_context import get_forward_context
from llmplug.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmplug.layers.weight_utils import ShardId
from llmplug.lora.adapter import LoRATarget

__all__ = ["LoRAMapping", "LoRASlots", "lora_target"]


@dataclass(frozen=True, slots=True)
class LoRAMapping:
    """Which slot each token of a step uses: a one-hot mask over slots 0 .. U - 1."""

    mask: torch.Tensor  # [T, U] in the model's dtype; a row of zeros: the base model only


def layer_parts(layer: LinearBase) -> tuple[ShardId | None, ...]:
    """The shard ids a checkpoint loads this layer by (None: loaded whole)."""
    if isinstance(layer, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(layer, MergedColumnParallelLinear):
        return tuple(range(len(layer.output_sizes)))
    return (None,)


def lora_target(layer: LinearBase) -> LoRATarget:
    """The full (unsharded) widths an adapter of `layer` must have."""
    if isinstance(layer, QKVParallelLinear):
        tp = layer.tp_size
        kv = layer.kv_size * tp // layer.num_kv_head_replicas
        return LoRATarget(layer.input_size, {"q": layer.q_size * tp, "k": kv, "v": kv})
    if isinstance(layer, MergedColumnParallelLinear):
        return LoRATarget(layer.input_size, dict(enumerate(layer.output_sizes)))
    if isinstance(layer, RowParallelLinear):
        return LoRATarget(layer.total_input_size, {None: layer.output_size})
    return LoRATarget(layer.input_size, {None: getattr(layer, "total_output_size", layer.output_size)})


class LoRASlots:
    """`max_loras` adapter slots of one linear layer; `apply` adds each token's adapter delta."""

    def __init__(self, layer: LinearBase, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.layer, self.parts, self.max_rank = layer, layer_parts(layer), max_rank
        width = len(self.parts) * max_rank
        self.lora_a = torch.zeros(max_loras, width, layer.input_size, dtype=dtype, device=device)
        self.lora_b = torch.zeros(layer.output_size, max_loras, width, dtype=dtype, device=device)

    def set_slot(self, slot: int, weights: Mapping[ShardId | None, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Load one adapter's (A, scaled B) per part into `slot` (this rank's shard); None or absent parts: zero."""
        self.lora_a[slot].zero_()
        self.lora_b[:, slot].zero_()
        row_parallel = isinstance(self.layer, RowParallelLinear)
        for i, part in enumerate(self.parts):
            if weights is None or part not in weights:
                continue
            a, b = weights[part]
            rank, cols = a.shape[0], slice(i * self.max_rank, i * self.max_rank + a.shape[0])
            a_dst, b_dst = self.lora_a[slot, cols], self.lora_b[:, slot, cols]
            if row_parallel:  # this rank's input columns of A; B whole
                self.layer._place(a_dst, a.to(a_dst.dtype), None)
                b_dst.copy_(b)
            else:  # A whole; this rank's rows of this part of B, where the base weight keeps them
                a_dst.copy_(a)
                b_part = torch.zeros(b_dst.shape[0], rank, dtype=b_dst.dtype, device=b_dst.device)
                self.layer._place(b_part, b.to(b_dst.dtype), part)
                b_dst.copy_(b_part)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add to y [T, out] the delta of each token's adapter on x [T, in] (nothing when no token has one)."""
        mapping: LoRAMapping | None = get_forward_context().lora_mapping
        if mapping is None:
            return y
        num_slots = mapping.mask.shape[1]
        a = self.lora_a[:num_slots].flatten(0, 1)  # [U * n * R, in], a view
        b = self.lora_b.flatten(1, 2)[:, : a.shape[0]]  # [out, U * n * R], a strided view
        shrink = F.linear(x, a).view(x.shape[0], num_slots, -1)  # [T, U, n * R]
        shrink = shrink * mapping.mask.unsqueeze(-1)
        return y.add_(F.linear(shrink.flatten(1, 2), b))
