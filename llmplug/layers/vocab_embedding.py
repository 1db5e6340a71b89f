"""Token embedding and LM head, with the vocabulary split across the tensor-parallel group.

Rank r holds rows [r * n, (r + 1) * n) of the [vocab, hidden] table, n = ceil(vocab / tp); the
last rank's rows past the vocabulary are zero padding and their logits are cut off.

Both have a `lora` hook (None unless LoRA is enabled, see llmplug/lora/layers.py) that adds each
token's adapter delta on this rank's vocabulary share, before the all-reduce or the gather.

The LM head (tied or not) computes through its `quant_method` and may get a packed int4 copy of its table
for small batches, like the linear layers (see layers/quantization.py). A GGUF loader may hand either layer
its table as raw blocks (`as_packed`, llmplug.quantization.gguf): the table then stays in them, the lookup
decoding only its rows and the head computing from the blocks (`GGUFTableMethod`), one copy when tied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.layers.linear import LoRAHook
from llmplug.layers.quantization import DENSE, LinearOptions, LinearMethod, linear_method_for, stage_int4, staged_int4
from llmplug.layers.weight_utils import check_shape, frozen_parameter
from llmplug.quantization import gguf as gguf_blocks  # the module: it imports llmplug.layers in turn

__all__ = ["ParallelLMHead", "VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """Embedding lookup over this rank's slice of the vocabulary, summed across ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "") -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_embeddings, self.embedding_dim, self.prefix = num_embeddings, embedding_dim, prefix
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        table = torch.empty(self.num_embeddings_per_partition, embedding_dim)
        self.dtype = table.dtype  # of the lookups, also from a packed table
        self.weight = frozen_parameter(table, self.weight_loader)
        self.weight_users: list[ParallelLMHead] = []  # heads tied to this table (told when it is reloaded)
        self.lora: LoRAHook | None = None  # adapter slots, attached by llmplug.lora when LoRA is enabled

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's vocabulary rows of the full [vocab, hidden] table; zero the padding rows.

        Exact int4 groups attached to the table are staged the same way, for a head that uses it. A packed
        GGUF table (`as_packed`) replaces the dense one: this rank's rows of blocks, padding rows all zero.
        """
        if gguf_blocks.packed_type(loaded_weight) is not None:
            vocab = (self.num_embeddings, self.vocab_start, self.vocab_end, self.num_embeddings_per_partition)
            shard = gguf_blocks.packed_table_shard(loaded_weight, self.embedding_dim, vocab, self.prefix)
            param.data = shard.to(param.device)
            gguf_blocks.as_packed(param, gguf_blocks.packed_type(loaded_weight))  # the object a tied head shares
        else:
            if gguf_blocks.packed_type(param) is not None:  # a dense table after a packed one
                shape = (self.num_embeddings_per_partition, self.embedding_dim)
                param.data = torch.empty(shape, dtype=self.dtype, device=param.device)
                gguf_blocks.as_packed(param, None)
            self._place(param.data, loaded_weight)
        if param is self.weight:
            for head in (self, *self.weight_users):
                if isinstance(head, ParallelLMHead):
                    head.quant_method = DENSE  # an int4 copy of the old table is stale
            stage_int4(param, loaded_weight, self._place)
            if (staging := staged_int4(param)) is not None:
                staging.filled[self.vocab_end - self.vocab_start :] = True  # padding rows: all-zero groups

    def _place(self, dst: torch.Tensor, loaded: torch.Tensor) -> None:
        """Copy this rank's vocabulary rows of `loaded` into `dst`; zero the rows past the vocabulary."""
        full_shape = (self.num_embeddings, *dst.shape[1:])  # [vocab, hidden], or [vocab] for a bias
        check_shape(torch.empty(full_shape, device="meta"), loaded)
        rows = self.vocab_end - self.vocab_start
        dst[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
        dst[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, embedding_dim]."""
        if self.tp_size == 1:
            out = self._rows(input_ids)
            return out if self.lora is None else self.lora.apply(input_ids, out)
        # ids owned by other ranks look up row 0 and are zeroed; the all-reduce fills them in
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(owned, input_ids - self.vocab_start, 0)
        out = self._rows(local)
        out = out * owned.unsqueeze(-1).to(out.dtype)
        if self.lora is not None:  # the delta of this rank's vocabulary; the all-reduce sums them
            out = self.lora.apply(input_ids, out)
        return get_tp_group().all_reduce(out)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of this rank's table: dense, or decoded from its blocks (only those rows)."""
        qtype = gguf_blocks.packed_type(self.weight)
        if qtype is None:
            return F.embedding(ids, self.weight)
        return gguf_blocks.packed_rows(self.weight, qtype, ids, self.dtype)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim={self.embedding_dim}, per_rank={self.num_embeddings_per_partition}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocabulary logits; may share its weight with the embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, prefix: str = "") -> None:
        super().__init__(num_embeddings, embedding_dim, prefix)
        per_rank = self.num_embeddings_per_partition
        self.bias = frozen_parameter(torch.empty(per_rank), self.weight_loader) if bias else None
        self.quant_method: LinearMethod = DENSE

    def tie_weights(self, embedding: VocabParallelEmbedding) -> "ParallelLMHead":
        """Use the embedding's table as the output projection (tie_word_embeddings)."""
        self.weight = embedding.weight
        embedding.weight_users.append(self)
        return self

    def process_weights_after_loading(self, options: LinearOptions) -> None:
        """Choose the quant method now that the table (and any staged int4 groups) are loaded: a packed GGUF table
        computes from its blocks."""
        qtype = gguf_blocks.packed_type(self.weight)
        if qtype is None:
            self.quant_method = linear_method_for(self.weight, options)
        else:
            self.quant_method = gguf_blocks.GGUFTableMethod(qtype)

    def get_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits in the model's dtype."""
        logits = self.quant_method.apply(self, hidden_states, self.bias)
        if self.lora is not None:  # the rows of this rank's vocabulary
            logits = self.lora.apply(hidden_states, logits)
        if self.tp_size > 1:
            logits = get_tp_group().all_gather(logits, dim=-1)
        padded = logits.shape[-1]
        return logits if padded == self.num_embeddings else logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Not a layer of the forward pass: the model calls get_logits on the sampled hidden states."""
        raise RuntimeError("ParallelLMHead is applied with get_logits(hidden_states), not called")
