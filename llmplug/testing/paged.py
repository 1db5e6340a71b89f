"""A minimal model runner for model-level tests: paged KV blocks, block tables, flattened batches.

It schedules what a test asks (which requests, how many tokens each), builds the step's
CommonAttentionMetadata exactly as the engine's model runner does, runs the model inside the
forward context, and returns every token's logits — raw logits of any position, for checks the
engine does not expose (prefix-cache hits on chosen blocks, chunks placed between decodes).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from llmplug.layers.attention import attention_layers, bind_kv_cache
from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.forward_context import CommonAttentionMetadata, forward_context

__all__ = ["PagedHarness", "Sequence"]


@dataclass
class Sequence:
    """One request: its known tokens, how many have K/V cached, and its blocks."""

    tokens: list[int]
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


class PagedHarness:
    """Owns the KV caches of `model` and runs flattened steps over named sequences."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:
        self.model, self.block_size, self.backend = model, block_size, TorchSDPABackend
        dtype = next(model.parameters()).dtype
        layers = attention_layers(model)
        caches = [torch.zeros(self.backend.layer_kv_cache_shape(layer, num_blocks, block_size), dtype=dtype)
                  for layer in layers]
        bind_kv_cache(model, caches, self.backend)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous block tables on purpose
        self.seqs: dict[str, Sequence] = {}

    def add(self, name: str, prompt: list[int], shared_blocks: list[int] = (), num_computed: int = 0) -> Sequence:
        """Register a request; `shared_blocks` (a prefix-cache hit) hold its first `num_computed` tokens."""
        self.seqs[name] = Sequence(list(prompt), num_computed, list(shared_blocks))
        return self.seqs[name]

    def _ensure_blocks(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.blocks) * self.block_size < num_tokens:
            seq.blocks.append(self.free_blocks.pop())

    def step(self, schedule: list[tuple[str, int]], lora_mapping: Any = None) -> dict[str, torch.Tensor]:
        """Run one step computing `n` new tokens of each (name, n); returns each request's logits [n, vocab].

        `lora_mapping` (llmplug.lora.layers.LoRAMapping): which adapter slot each token of the step uses.
        """
        ids, positions, slots, q_lens, seq_lens, computed, tables = [], [], [], [], [], [], []
        for name, n in schedule:
            seq = self.seqs[name]
            start = seq.num_computed
            self._ensure_blocks(seq, start + n)
            for pos in range(start, start + n):
                ids.append(seq.tokens[pos])
                positions.append(pos)
                slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            q_lens.append(n)
            seq_lens.append(start + n)
            computed.append(start)
            tables.append(seq.blocks)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        q_lens_t = torch.tensor(q_lens)
        common = CommonAttentionMetadata(
            query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(q_lens_t, 0)]),
            seq_lens=torch.tensor(seq_lens),
            num_computed_tokens=torch.tensor(computed),
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots),
            positions=torch.tensor(positions),
            block_size=self.block_size,
            num_reqs=len(schedule),
            num_tokens=len(ids),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_list=tuple(q_lens),
            seq_lens_list=tuple(seq_lens),
        )
        with torch.inference_mode(), forward_context(self.backend.build_metadata(common), lora_mapping=lora_mapping):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
            logits = self.model.compute_logits(hidden)
        for name, n in schedule:
            self.seqs[name].num_computed += n
        return dict(zip((name for name, _ in schedule), torch.split(logits, q_lens)))
