"""The self-attention block of the generic decoder: fused q/k/v projection, optional clamp and q/k norms,
in-place rotary, paged attention (with the layer's window, soft-cap, ALiBi, sinks), output projection."""

from __future__ import annotations

import torch
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.layers.attention import Attention, alibi_slopes
from llmplug.layers.decoder.arch import DecoderArchConfig, LayerConfig
from llmplug.layers.linear import QKVParallelLinear, RowParallelLinear
from llmplug.layers.qk_norm import make_qk_norm
from llmplug.layers.rotary import RotaryCosSin

__all__ = ["DecoderAttention"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class DecoderAttention(nn.Module):
    """Attention over this rank's heads; `o_proj` sums the ranks' outputs unless `reduce_results=False`."""

    def __init__(
        self, arch: DecoderArchConfig, layer: LayerConfig, prefix: str = "", reduce_results: bool = True
    ) -> None:
        super().__init__()
        d = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, d, arch.num_heads, arch.num_kv_heads, arch.qkv_bias, _join(prefix, "qkv_proj")
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            arch.num_heads * d,
            arch.hidden_size,
            arch.o_proj_bias,
            reduce_results=reduce_results,
            prefix=_join(prefix, "o_proj"),
        )
        self.clip_qkv, self.qk_norm_after_rope = arch.clip_qkv, arch.qk_norm_after_rope
        self.q_norm, self.k_norm = self._qk_norms(arch)
        self.attn = Attention(
            self.num_heads,
            d,
            arch.scale,
            self.num_kv_heads,
            prefix=_join(prefix, "attn"),
            sliding_window=layer.sliding_window,
            logit_softcap=arch.attn_logit_softcap,
            alibi_slopes=self._alibi_slopes(arch) if arch.alibi else None,
            use_sinks=arch.attention_sinks,
        )

    def _qk_norms(self, arch: DecoderArchConfig) -> tuple[nn.Module | None, nn.Module | None]:
        """The q and k norms over this rank's heads (KV heads replicated over ranks: the replicated one)."""
        if arch.qk_norm is None:
            return None, None
        rank, proj = self.qkv_proj.tp_rank, self.qkv_proj
        first_kv_head = (rank // proj.num_kv_head_replicas) * self.num_kv_heads
        return (
            make_qk_norm(arch.qk_norm, self.num_heads, self.head_dim, rank * self.num_heads),
            make_qk_norm(arch.qk_norm, self.num_kv_heads, self.head_dim, first_kv_head),
        )

    def _norm_qk_(self, qk: torch.Tensor) -> None:
        """Normalize q and k of qk [T, H + Hkv, D] in place (no norm: nothing)."""
        if self.q_norm is not None:
            qk[:, : self.num_heads] = self.q_norm(qk[:, : self.num_heads])
            qk[:, self.num_heads :] = self.k_norm(qk[:, self.num_heads :])

    def _alibi_slopes(self, arch: DecoderArchConfig) -> torch.Tensor:
        """[num_heads of this rank] float32 ALiBi slopes (times the attention scale where the family scales them)."""
        slopes = alibi_slopes(arch.num_heads, arch.alibi_max_bias)
        first = get_tp_group().rank_in_group * self.num_heads
        slopes = slopes[first : first + self.num_heads]
        return slopes * arch.scale if arch.alibi_scaled else slopes

    def forward(self, hidden: torch.Tensor, rope: RotaryCosSin | None) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] (this rank's partial sum when reduce_results=False)."""
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * Hkv) * D]
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        qk = qkv[:, :k_end].view(qkv.shape[0], self.num_heads + self.num_kv_heads, self.head_dim)  # [T, H + Hkv, D]
        if not self.qk_norm_after_rope:
            self._norm_qk_(qk)
        if rope is not None:
            rope.apply_(qk)  # rotates q and k inside qkv
        if self.qk_norm_after_rope:
            self._norm_qk_(qk)
        out = self.attn(qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:])  # [T, H * D]
        return self.o_proj(out)
