"""The Attention layer models use: dispatches to the attention backend bound by the model runner."""

from __future__ import annotations

import torch
from torch import nn

from llmplug.layers.attention.backend import AttentionBackend
from llmplug.layers.forward_context import get_forward_context

__all__ = ["Attention"]


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over this layer's KV cache.

    Holds no weights. `kv_cache` and `backend` are set by `bind_kv_cache`; the step's metadata comes
    from the forward context. q, k, v arrive after projection and rotary embedding, flattened per
    token, and may be strided views (e.g. slices of a fused qkv output).
    """

    def __init__(
        self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot be grouped over {self.num_kv_heads} KV heads")
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.layer_name = prefix
        self.kv_cache: torch.Tensor | None = None  # not a buffer: owned by the model runner, not the checkpoint
        self.backend: type[AttentionBackend] | None = None
        self.backend_state: object | None = None  # the backend's per-layer scratch kept across steps

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H * D], k and v [T, Hkv * D] -> [T, H * D]; k, v are stored in the cache."""
        if self.backend is None:
            raise RuntimeError(
                f"Attention layer {self.layer_name!r} has no backend: the model runner calls "
                "bind_kv_cache(model, caches, backend) before the first forward"
            )
        return self.backend.forward(self, q, k, v, get_forward_context().attn_metadata)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, scale={self.scale:.4g}"
