"""Multi-head latent attention (MLA, DeepSeek V2/V3) in its absorbed form: attention over the cached latent.

Per token the KV cache holds only the latent [c_kv | k_pe] (kv_lora_rank + qk_rope_head_dim values),
never the expanded heads. Each head's key would be [W_uk^h c_kv | k_pe] and its value W_uv^h c_kv, so

    q^h . k^h = (W_uk^h^T q_nope^h) . c_kv + q_pe^h . k_pe      (the query is absorbed into latent space)
    out^h     = W_uv^h (sum_j p_j c_kv_j)                       (the value projection after the sum)

which is multi-query attention with one "KV head", the latent, whose values are the keys' first
kv_lora_rank dims (`Attention(..., values_in_keys=kv_lora_rank)`). W_uk and W_uv are read from
kv_b_proj's weight (transformers' name), which is therefore kept dense. Prefill uses the same form:
correct, though a long prompt would be cheaper expanded (not done here).

Tensor parallelism splits the heads (q_proj / q_b_proj, kv_b_proj by rows, o_proj by columns); the
latent projections and norms are replicated, so every rank caches the same latent.
"""

from __future__ import annotations

import torch
from torch import nn

from llmplug.layers.attention import Attention
from llmplug.layers.decoder.arch import DecoderArchConfig, MLAConfig
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from llmplug.layers.quantization import LinearOptions
from llmplug.communicators.parallel_state import get_tp_group
from llmplug.layers.rotary import RotaryCosSin
from llmplug.layers.rowwise import rowwise_bmm

__all__ = ["LatentAttention"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _AbsorbedProjection(ColumnParallelLinear):
    """kv_b_proj: loaded as a column-parallel layer (this rank's heads), never applied as one: its weight
    is split into W_uk and W_uv and absorbed, so it stays dense (no int4 or packed copy)."""

    def process_weights_after_loading(self, options: LinearOptions) -> None:
        """Keep the dense weight the attention reads."""


class LatentAttention(nn.Module):
    """MLA over this rank's heads (see the module doc); `o_proj` sums the ranks unless `reduce_results=False`."""

    def __init__(self, arch: DecoderArchConfig, prefix: str = "", reduce_results: bool = True) -> None:
        super().__init__()
        mla: MLAConfig = arch.mla
        self.mla, hidden = mla, arch.hidden_size
        self.num_heads = divide(arch.num_heads, get_tp_group().world_size, "attention heads")
        q_size = arch.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_size, False, prefix=_join(prefix, "q_proj"))
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, mla.latent_bias, _join(prefix, "q_a_proj"))
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, mla.latent_norm_eps)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_size, False, prefix=_join(prefix, "q_b_proj"))
        latent = mla.kv_lora_rank + mla.qk_rope_head_dim
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, latent, mla.latent_bias, _join(prefix, "kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, mla.latent_norm_eps)
        self.kv_b_proj = _AbsorbedProjection(
            mla.kv_lora_rank, arch.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), False,
            prefix=_join(prefix, "kv_b_proj"),
        )
        self.o_proj = RowParallelLinear(
            arch.num_heads * mla.v_head_dim, hidden, arch.o_proj_bias, reduce_results=reduce_results,
            prefix=_join(prefix, "o_proj"),
        )
        self.attn = Attention(
            self.num_heads, latent, arch.scale, 1, prefix=_join(prefix, "attn"), values_in_keys=mla.kv_lora_rank
        )

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> this rank's queries [T, H, nope + rope]."""
        if self.mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.view(hidden.shape[0], self.num_heads, self.mla.qk_head_dim)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [H, nope, kv_lora_rank], W_uv [H, v, kv_lora_rank]) of this rank's heads: views of kv_b_proj."""
        mla = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]

    def forward(
        self, hidden: torch.Tensor, rope: RotaryCosSin | None, query_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] (this rank's partial sum when reduce_results=False). The decoder passes
        every attention its `query_scale`; no latent-attention family scales queries by position."""
        if query_scale is not None:
            raise NotImplementedError("query_position_scale with latent attention")
        mla, num_tokens = self.mla, hidden.shape[0]
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        q = self._query(hidden)  # [T, H, nope + rope]
        latent = self.kv_a_proj_with_mqa(hidden)  # [T, rank + rope]
        key = torch.cat([self.kv_a_layernorm(latent[:, :rank]), latent[:, rank:]], dim=-1)  # [T, rank + rope]
        if rope is not None:  # q_pe and k_pe rotated in place
            rope.apply_(q[..., nope:])
            rope.apply_(key[:, rank:].unsqueeze(1))
        w_uk, w_uv = self._absorbed()
        q_latent = rowwise_bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat([q_latent, q[..., nope:]], dim=-1)  # [T, H, rank + rope]
        out = self.attn(query.reshape(num_tokens, -1), key)  # [T, H * rank]: sums of the cached c_kv
        out = rowwise_bmm(out.view(num_tokens, self.num_heads, rank).transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, self.num_heads * mla.v_head_dim))
