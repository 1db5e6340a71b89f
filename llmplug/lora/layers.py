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

The token embedding and the LM head (PEFT's `embed_tokens` and `lm_head` targets) get slots too. The
embedding's shrink is a lookup — row `id` of A^T, PEFT's `lora_embedding_A` [r, vocab] — instead of a
matmul; the head is a linear layer hidden -> vocabulary. A layer skips the compute when none of the
step's slots holds weights for it, so adapters without an embedding or head part cost nothing there.

Under tensor parallelism the slots are sharded like the base weight, with the layer's own `_place`:
a column-parallel layer keeps A whole and its rows of B; a row-parallel layer keeps its columns of A
and B whole, and its partial deltas are summed by the layer's all-reduce with the base output. The
vocabulary-parallel layers split the vocabulary as their tables do: the embedding keeps its vocabulary
columns of A (a token of another rank looks up zeros) and B whole, and its partial delta joins the
lookup's all-reduce; the head keeps A whole and its vocabulary rows of B (zero past the vocabulary),
and its logits are gathered with the base logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from llmplug.layers.forward_context import current_lora_mapping
from llmplug.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmplug.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmplug.layers.weight_utils import ShardId
from llmplug.lora.adapter import LoRATarget

__all__ = ["EmbeddingLoRASlots", "LMHeadLoRASlots", "LoRAMapping", "LoRASlots", "lora_slots", "lora_target"]

# a layer LoRA can adapt: a linear layer, the token embedding or the LM head
Adaptable = LinearBase | VocabParallelEmbedding


@dataclass(frozen=True, slots=True)
class LoRAMapping:
    """Which slot each token of a step uses: a one-hot mask over slots 0 .. U - 1."""

    mask: torch.Tensor  # [T, U] in the model's dtype; a row of zeros: the base model only

    def rows(self, index: torch.Tensor | slice) -> "LoRAMapping":
        """The mapping of the rows `index` of the step's tokens (those the LM head computes logits for)."""
        return LoRAMapping(self.mask[index])


def layer_parts(layer: Adaptable) -> tuple[ShardId | None, ...]:
    """The shard ids a checkpoint loads this layer by (None: loaded whole)."""
    if isinstance(layer, QKVParallelLinear):
        return ("q", "k", "v")
    if isinstance(layer, MergedColumnParallelLinear):
        return tuple(range(len(layer.output_sizes)))
    return (None,)


def lora_target(layer: Adaptable) -> LoRATarget:
    """The full (unsharded) widths an adapter of `layer` must have."""
    if isinstance(layer, ParallelLMHead):
        return LoRATarget(layer.embedding_dim, {None: layer.num_embeddings})
    if isinstance(layer, VocabParallelEmbedding):  # A [r, vocab] is looked up, B [dim, r]
        return LoRATarget(layer.num_embeddings, {None: layer.embedding_dim}, embedding=True)
    if isinstance(layer, QKVParallelLinear):
        tp = layer.tp_size
        kv = layer.kv_size * tp // layer.num_kv_head_replicas
        return LoRATarget(layer.input_size, {"q": layer.q_size * tp, "k": kv, "v": kv})
    if isinstance(layer, MergedColumnParallelLinear):
        return LoRATarget(layer.input_size, dict(enumerate(layer.output_sizes)))
    if isinstance(layer, RowParallelLinear):
        return LoRATarget(layer.total_input_size, {None: layer.output_size})
    return LoRATarget(layer.input_size, {None: getattr(layer, "total_output_size", layer.output_size)})


def lora_slots(
    layer: Adaptable, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> "LoRASlots":
    """The slots of `layer`, of the kind its compute and sharding need."""
    if isinstance(layer, ParallelLMHead):
        cls: type[LoRASlots] = LMHeadLoRASlots
    elif isinstance(layer, VocabParallelEmbedding):
        cls = EmbeddingLoRASlots
    else:
        cls = LoRASlots
    return cls(layer, max_loras, max_rank, dtype, device)


class LoRASlots:
    """`max_loras` adapter slots of one linear layer; `apply` adds each token's adapter delta."""

    def __init__(self, layer: Adaptable, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.layer, self.parts, self.max_rank = layer, layer_parts(layer), max_rank
        width = len(self.parts) * max_rank
        in_width, out_width = self._local_widths()
        self.lora_a = torch.zeros(max_loras, width, in_width, dtype=dtype, device=device)
        self.lora_b = torch.zeros(out_width, max_loras, width, dtype=dtype, device=device)
        self.filled: set[int] = set()  # the slots that hold weights for this layer

    def _local_widths(self) -> tuple[int, int]:
        """(A's columns, B's rows) on this rank."""
        return self.layer.input_size, self.layer.output_size

    def set_slot(self, slot: int, weights: Mapping[ShardId | None, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Load one adapter's (A, scaled B) per part into `slot` (this rank's shard); None or absent parts: zero."""
        self.lora_a[slot].zero_()
        self.lora_b[:, slot].zero_()
        self.filled.discard(slot)
        for i, part in enumerate(self.parts):
            if weights is None or part not in weights:
                continue
            a, b = weights[part]
            cols = slice(i * self.max_rank, i * self.max_rank + a.shape[0])
            a_dst, b_dst = self.lora_a[slot, cols], self.lora_b[:, slot, cols]
            self._place(a_dst, b_dst, a.to(a_dst.dtype), b.to(b_dst.dtype), part)
            self.filled.add(slot)

    def _place(self, a_dst: torch.Tensor, b_dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, part: ShardId | None
               ) -> None:
        """Copy this rank's shards of one part's A [r, in] and B [out, r] into the slot's views."""
        if isinstance(self.layer, RowParallelLinear):  # this rank's input columns of A; B whole
            self.layer._place(a_dst, a, None, output_dim=None)
            b_dst.copy_(b)
        else:  # A whole; this rank's rows of this part of B, where the base weight keeps them
            a_dst.copy_(a)
            b_part = torch.zeros_like(b_dst)
            self.layer._place(b_part, b, part)
            b_dst.copy_(b_part)

    def _shrink(self, x: torch.Tensor, num_slots: int) -> torch.Tensor:
        """x [T, in] -> [T, U * n * R] against the first `num_slots` slots' A (a view: no copy)."""
        return F.linear(x, self.lora_a[:num_slots].flatten(0, 1))

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Add to y [T, out] the delta of each token's adapter on x [T, in] (nothing when no token has one)."""
        mapping: LoRAMapping | None = current_lora_mapping()
        if mapping is None:
            return y
        num_slots = mapping.mask.shape[1]
        if self.filled.isdisjoint(range(num_slots)):  # no adapter of the step adapts this layer
            return y
        shrink = self._shrink(x, num_slots).view(x.shape[0], num_slots, -1)  # [T, U, n * R]
        shrink = shrink * mapping.mask.unsqueeze(-1)
        b = self.lora_b.flatten(1, 2)[:, : num_slots * shrink.shape[-1]]  # [out, U * n * R], a strided view
        return y.add_(F.linear(shrink.flatten(1, 2), b))


class EmbeddingLoRASlots(LoRASlots):
    """Slots of the token embedding: A^T is looked up by token id (PEFT's lora_embedding_A / _B)."""

    layer: VocabParallelEmbedding

    def _local_widths(self) -> tuple[int, int]:
        return self.layer.num_embeddings_per_partition, self.layer.embedding_dim

    def _place(self, a_dst: torch.Tensor, b_dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, part: ShardId | None
               ) -> None:
        self.layer._place(a_dst.t(), a.t())  # this rank's vocabulary columns of A; B whole
        b_dst.copy_(b)

    def _shrink(self, x: torch.Tensor, num_slots: int) -> torch.Tensor:
        """token ids [T] -> [T, U * R]: their columns of A; zeros for tokens of another rank's vocabulary."""
        layer, table = self.layer, self.lora_a[:num_slots].flatten(0, 1).t()  # [vocab / tp, U * R], a view
        if layer.tp_size == 1:
            return F.embedding(x, table)
        owned = (x >= layer.vocab_start) & (x < layer.vocab_end)
        return F.embedding(torch.where(owned, x - layer.vocab_start, 0), table) * owned.unsqueeze(-1).to(table.dtype)


class LMHeadLoRASlots(LoRASlots):
    """Slots of the LM head: A whole, this rank's vocabulary rows of B (zero past the vocabulary)."""

    layer: ParallelLMHead

    def _local_widths(self) -> tuple[int, int]:
        return self.layer.embedding_dim, self.layer.num_embeddings_per_partition

    def _place(self, a_dst: torch.Tensor, b_dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, part: ShardId | None
               ) -> None:
        a_dst.copy_(a)
        self.layer._place(b_dst, b)
