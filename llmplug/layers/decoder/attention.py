"""The self-attention block of the generic decoder: fused q/k/v projection, optional clamp and q/k norms
(before or after rotary), in-place rotary, an optional per-position query scale, paged attention (with the
layer's window, chunk, soft-cap, ALiBi, sinks), optional output gate, output projection.

With `attention_output_gate` (Qwen3-Next) the checkpoint's q_proj gives each head [q | gate]: the fused
projection holds it as twice the query heads (so a tensor-parallel rank keeps whole pairs), and the
attention output is multiplied by sigmoid(gate) before o_proj."""

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
        self.gated = arch.attention_output_gate
        q_heads = 2 * arch.num_heads if self.gated else arch.num_heads  # a gate "head" beside each query head
        self.qkv_proj = QKVParallelLinear(
            layer.attention_input_size or arch.hidden_size, d, q_heads, arch.num_kv_heads, arch.qkv_bias, _join(prefix, "qkv_proj")
        )
        self.num_heads = self.qkv_proj.num_heads // 2 if self.gated else self.qkv_proj.num_heads
        self.num_kv_heads, self.head_dim = self.qkv_proj.num_kv_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            arch.num_heads * d,
            arch.hidden_size,
            arch.o_proj_bias or layer.o_proj_bias,
            reduce_results=reduce_results,
            prefix=_join(prefix, "o_proj"),
        )
        self.clip_qkv, self.key_multiplier = arch.clip_qkv, arch.key_multiplier
        self.q_norm, self.k_norm = self._qk_norms(arch) if layer.qk_norm else (None, None)
        self.query_scaled = layer.query_scale
        self.qk_norm_after_rope = arch.qk_norm is not None and arch.qk_norm.after_rope
        self.attn = Attention(
            self.num_heads,
            d,
            arch.scale,
            self.num_kv_heads,
            prefix=_join(prefix, "attn"),
            sliding_window=layer.sliding_window,
            attention_chunk=layer.attention_chunk,
            logit_softcap=arch.attn_logit_softcap,
            alibi_slopes=self._alibi_slopes(arch) if arch.alibi else None,
            use_sinks=arch.attention_sinks,
            causal=arch.causal,
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

    def forward(
        self, hidden: torch.Tensor, rope: RotaryCosSin | None, query_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] (this rank's partial sum when reduce_results=False); `query_scale`
        [T, 1, 1] multiplies q after rotary (the decoder's `query_position_scale`)."""
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * Hkv) * D]; gated: [T, (2 H + 2 * Hkv) * D]
        if self.gated:
            qkv, gate = self._ungate(qkv)
            return self.o_proj(self._attend(qkv, rope, query_scale).mul_(torch.sigmoid(gate)))
        return self.o_proj(self._attend(qkv, rope, query_scale))

    def _ungate(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H * (q | gate) + 2 Hkv * D] -> (qkv [T, (H + 2 Hkv) * D], gate [T, H * D])."""
        pairs = qkv[:, : 2 * self.q_size].unflatten(-1, (self.num_heads, 2 * self.head_dim))
        q, gate = pairs[..., : self.head_dim], pairs[..., self.head_dim :]
        return torch.cat([q.flatten(1), qkv[:, 2 * self.q_size :]], dim=1), gate.flatten(1)

    def _attend(self, qkv: torch.Tensor, rope: RotaryCosSin | None, query_scale: torch.Tensor | None) -> torch.Tensor:
        """[T, (H + 2 Hkv) * D] -> the attention output [T, H * D]."""
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        if self.key_multiplier != 1.0:
            qkv[:, q_end:k_end].mul_(self.key_multiplier)
        qk = qkv[:, :k_end].view(qkv.shape[0], self.num_heads + self.num_kv_heads, self.head_dim)  # [T, H + Hkv, D]
        if not self.qk_norm_after_rope:
            self._norm_qk_(qk)
        if rope is not None:
            rope.apply_(qk)  # rotates q and k inside qkv
        if self.qk_norm_after_rope:
            self._norm_qk_(qk)
        if query_scale is not None and self.query_scaled:
            qk[:, : self.num_heads].mul_(query_scale)
        return self.attn(qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:])  # [T, H * D]
