"""Cross-attention of an encoder-decoder model (Whisper): the decoder's queries over its request's encoder states.

The keys and values come from the encoder's output, which is fixed for a request's whole life: they are computed
once per request (`CrossAttention.kv`, at its first step and again after a preemption) and kept by the model runner
beside the request (engine/model_runner.py), not in paged blocks — every decode step reads all of them, and an
encoder window has a fixed size (Whisper: 1500 states), so there is nothing to page in or share by prefix. Each
step passes them in a `CrossAttentionBatch`; the attention is softmax(q kᵀ / sqrt(head_dim)) v per request (its step
rows against its own states: two matmuls, 2-4x faster on the CPU than torch's `scaled_dot_product_attention` kernel
for a few query rows against 1500 keys), so a request's rows never depend on what else the step holds. Their memory
is budgeted before the KV blocks (`KVCacheSpec.cross_attention_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmplug.layers.linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["CrossAttention", "CrossAttentionBatch"]


@dataclass(frozen=True, slots=True)
class CrossAttentionBatch:
    """One step's cross-attention inputs: request r's rows are [query_start_loc[r], query_start_loc[r + 1]) of the
    step's tokens, and kv[r] its keys and values [layers, 2, heads, encoder states, head_dim] (None: the request's
    encoder failed; it ends this step and its rows get no cross-attention)."""

    query_start_loc: tuple[int, ...]
    kv: tuple[torch.Tensor | None, ...]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class CrossAttention(nn.Module):
    """Multi-head attention of decoder rows over encoder states, this rank's heads (q/k/v column-parallel,
    out row-parallel); the key projection has no bias (Whisper's)."""

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

    def kv(self, encoder_states: torch.Tensor) -> torch.Tensor:
        """encoder_states [S, hidden] -> this layer's keys and values [2, heads, S, head_dim]."""
        k = self.key(encoder_states).view(-1, self.num_heads, self.head_dim)  # [S, H, D]
        v = self.value(encoder_states).view(-1, self.num_heads, self.head_dim)
        return torch.stack([k, v]).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, batch: CrossAttentionBatch | None, layer_index: int) -> torch.Tensor:
        """[T, hidden] -> [T, hidden], against each request's kv[layer_index] (None: no request has any, as in the
        engine's memory-profiling step)."""
        if batch is None:
            return self.out_proj(torch.zeros_like(hidden))
        q = self.query(hidden).view(-1, self.num_heads, self.head_dim).transpose(0, 1)  # [H, T, D]
        out = torch.zeros_like(q)
        starts = batch.query_start_loc
        for r, kv in enumerate(batch.kv):
            if kv is not None:
                k, v = kv[layer_index]  # each [H, S, D]
                rows = slice(starts[r], starts[r + 1])
                scores = torch.matmul(q[:, rows], k.transpose(1, 2)).mul_(self.scale)  # [H, n, S]
                out[:, rows] = torch.matmul(scores.softmax(-1), v)
        return self.out_proj(out.transpose(0, 1).reshape(hidden.shape[0], -1))
