"""Cross-attention of an encoder-decoder model (Whisper): the decoder's queries over its request's encoder states.

The keys and values come from the encoder's output, fixed for a request's whole life. They live in paged blocks of
their own, the request's cross blocks (engine/kv_cache.py: ceil(encoder states / block_size) blocks of the same pool
as the decoder's), inside the cache tensor of the decoder layer's self-attention, which has the same heads and head_dim
(vLLM's hybrid allocator lets a layer of each KV group share one tensor the same way): one block id names the same
slots in every layer. They are written once per request (`CrossAttention.store`: at its first step, or when it resumes
after a preemption that let its blocks be evicted) and each step reads them through the request's `CrossBlocks`.

The attention is softmax(q kᵀ / sqrt(head_dim)) v per request, its step rows against its own states: two matmuls, 2-4x
faster on the CPU than torch's `scaled_dot_product_attention` kernel for a few query rows against 1500 keys, and a
request's rows never depend on what else the step holds. Blocks with consecutive ids (the KV manager gives a request
such a run when the free blocks hold one) are read as a view of the cache, others are gathered (a copy per layer and
step: 3-4x the attention's time on the CPU).

The cache tensor's layout is the attention backend's: `paged_view` reads it as [2 (K, V), heads, blocks, block_size,
head_dim], a view of the same memory, found from the shape the backend gives for distinct sizes; a backend whose
layout is not a permutation of those five dimensions is refused by name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.linear import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from llmplug.layers.attention.backend import AttentionBackend
    from llmplug.layers.attention.layer import Attention

__all__ = ["CrossAttention", "CrossAttentionBatch", "CrossBlocks", "paged_view"]


@dataclass(frozen=True, slots=True)
class CrossBlocks:
    """Where one request's encoder keys and values are: the first `num_tokens` slots of blocks `block_ids`."""

    block_ids: torch.Tensor  # [n] int64, on the cache's device
    first: int | None  # the ids are first, first + 1, ...: read as a view of the cache; None: gathered
    num_tokens: int  # the encoder's states (Whisper: 1500)

    @classmethod
    def of(cls, block_ids: list[int], num_tokens: int, device: torch.device) -> CrossBlocks:
        """The blocks the scheduler gave a request, on `device`."""
        consecutive = block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids)))
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        return cls(ids, block_ids[0] if consecutive else None, num_tokens)

    def read(self, view: torch.Tensor) -> torch.Tensor:
        """view [2, H, num_blocks, block_size, D] -> these blocks' keys and values [2, H, num_tokens, D]."""
        if self.first is not None:
            blocks = view.narrow(2, self.first, len(self.block_ids))
        else:
            blocks = view.index_select(2, self.block_ids)
        return blocks.flatten(2, 3)[:, :, : self.num_tokens]

    def write(self, view: torch.Tensor, kv: torch.Tensor) -> None:
        """Store kv [2, H, num_tokens, D] into these blocks of view [2, H, num_blocks, block_size, D]."""
        num_blocks, block_size = len(self.block_ids), view.shape[3]
        padded = F.pad(kv, (0, 0, 0, num_blocks * block_size - kv.shape[2]))  # the last block's tail: zeros
        view.index_copy_(2, self.block_ids, padded.unflatten(2, (num_blocks, block_size)).to(view.dtype))


@dataclass(frozen=True, slots=True)
class CrossAttentionBatch:
    """One step's cross-attention inputs: request r's rows are [query_start_loc[r], query_start_loc[r + 1]) of the
    step's tokens, and blocks[r] its cross blocks (None: the request's encoder failed; it ends this step and its rows
    get no cross-attention)."""

    query_start_loc: tuple[int, ...]
    blocks: tuple[CrossBlocks | None, ...]


@functools.cache
def _permutation(backend: type[AttentionBackend]) -> tuple[int, ...]:
    """The order of the backend's cache dimensions that reads as (K/V, heads, blocks, block_size, head_dim)."""
    num_blocks, block_size, heads, head_dim = 11, 13, 17, 19  # distinct, and none is 2 (K, V)
    shape = tuple(backend.kv_cache_shape(num_blocks, block_size, heads, head_dim))
    wanted = (2, heads, num_blocks, block_size, head_dim)
    if sorted(shape) != sorted(wanted):
        raise ValueError(
            f"attention backend {backend.name or backend.__name__!r} lays out 11 blocks of 13 tokens, 17 heads of "
            f"19 dims as {shape}, not a permutation of (K/V, heads, blocks, block_size, head_dim): cross-attention "
            "cannot keep its keys and values in its cache; choose another backend (device.attention_backend)"
        )
    return tuple(shape.index(size) for size in wanted)


def paged_view(layer: Attention) -> torch.Tensor:
    """`layer`'s cache tensor as [2 (K, V), heads, num_blocks, block_size, head_dim] (a view of the same memory)."""
    return layer.kv_cache.permute(_permutation(layer.backend))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class CrossAttention(nn.Module):
    """Multi-head attention of decoder rows over encoder states, this rank's heads (q/k/v column-parallel,
    out row-parallel); the key projection has no bias (Whisper's). Its keys and values are kept in the cache of
    `cache_layer`, an attention layer with the same heads and head_dim."""

    def __init__(self, hidden_size: int, num_heads: int, prefix: str = "") -> None:
        super().__init__()
        # not q_proj / k_proj / v_proj: those names are the decoder's fused self-attention's (stacked_params)
        self.query = ColumnParallelLinear(hidden_size, hidden_size, True, prefix=_join(prefix, "query"))
        self.key = ColumnParallelLinear(hidden_size, hidden_size, False, prefix=_join(prefix, "key"))
        self.value = ColumnParallelLinear(hidden_size, hidden_size, True, prefix=_join(prefix, "value"))
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, True, prefix=_join(prefix, "out_proj"))
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim**-0.5  # as the checkpoints were trained
        self.num_heads = self.query.output_size // self.head_dim  # this rank's
        self.layer_name = prefix

    def kv(self, encoder_states: torch.Tensor) -> torch.Tensor:
        """encoder_states [S, hidden] -> this layer's keys and values [2, heads, S, head_dim]."""
        k = self.key(encoder_states).view(-1, self.num_heads, self.head_dim)  # [S, H, D]
        v = self.value(encoder_states).view(-1, self.num_heads, self.head_dim)
        return torch.stack([k, v]).transpose(1, 2)

    def store(self, encoder_states: torch.Tensor, cache_layer: Attention, blocks: CrossBlocks) -> None:
        """Write the keys and values of encoder_states [S, hidden] into `blocks` of cache_layer's cache."""
        view = paged_view(cache_layer)
        if (view.shape[1], view.shape[4]) != (self.num_heads, self.head_dim):
            raise ValueError(
                f"{self.layer_name}: {self.num_heads} heads of {self.head_dim} dims cannot be kept in the cache of "
                f"{cache_layer.layer_name}, of {view.shape[1]} heads of {view.shape[4]} dims"
            )
        blocks.write(view, self.kv(encoder_states))

    def forward(self, hidden: torch.Tensor, batch: CrossAttentionBatch | None, cache_layer: Attention) -> torch.Tensor:
        """[T, hidden] -> [T, hidden], against each request's keys and values in cache_layer's cache (batch None: no
        request has any, as in the engine's memory-profiling step)."""
        if batch is None:
            return self.out_proj(torch.zeros_like(hidden))
        q = self.query(hidden).view(-1, self.num_heads, self.head_dim).transpose(0, 1)  # [H, T, D]
        out = torch.zeros_like(q)
        view, starts = paged_view(cache_layer), batch.query_start_loc
        for r, blocks in enumerate(batch.blocks):
            if blocks is not None:
                k, v = blocks.read(view)  # each [H, S, D]
                rows = slice(starts[r], starts[r + 1])
                # k qᵀ rather than q kᵀ: a view's keys are strided per head, which q kᵀ in bfloat16 on the CPU takes
                # 5-15x longer over (k qᵀ the same as over contiguous keys)
                scores = torch.matmul(k, q[:, rows].transpose(1, 2)).transpose(1, 2).mul_(self.scale)  # [H, n, S]
                out[:, rows] = torch.matmul(scores.softmax(-1), v)
        return self.out_proj(out.transpose(0, 1).reshape(hidden.shape[0], -1))
