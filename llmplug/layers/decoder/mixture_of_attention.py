"""Mixture of attention heads (JetMoe's MoA): a router picks, per token, top_k of num_experts (query,
output) projection pairs; the keys and values are one projection shared by every expert.

Per token t with chosen experts e_1..e_k and routing weights w_1..w_k:

    q_j = Wq[e_j] x_t                       [Hkv * D]: Hkv query heads per chosen expert
    k, v = kv_proj(x_t)                     [Hkv * D] each, rotated / cached like any GQA layer
    o_j = attention(q_j heads over k, v)    query head h of expert j reads KV head h
    out = sum_j w_j * Wo[e_j] o_j (+ bias)

So the layer is grouped-query attention with top_k * Hkv query heads: expert j's head h is query head
h * top_k + j, which the backend's grouping (query head // top_k) sends to KV head h. The experts'
projections are stacked tensors (`q_experts` [E, Hkv * D, hidden], `o_experts` [E, hidden, Hkv * D],
the checkpoint's own layout) computed by grouping the (token, expert) assignments per expert, as the
MoE MLP does. Under tensor parallelism each rank holds Hkv / tp KV heads and their rows (columns) of
every expert; the partial outputs are all-reduced once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.layers.attention import Attention
from llmplug.layers.decoder.arch import DecoderArchConfig
from llmplug.layers.linear import MergedColumnParallelLinear, divide
from llmplug.layers.moe.experts import group_by_expert
from llmplug.layers.moe.router import Router
from llmplug.layers.packed_linear import cpu_dense_method
from llmplug.layers.rotary import RotaryCosSin
from llmplug.layers.weight_utils import ShardId, check_shape, frozen_parameter

if TYPE_CHECKING:
    from llmplug.layers.quantization import LinearMethod, LinearOptions

__all__ = ["MixtureOfAttention", "StackedExpertLinear"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class StackedExpertLinear(nn.Module):
    """One linear projection per expert, stacked as `weight` [E, out, in]; this rank holds a slice of every
    expert along `shard_dim` (0: output rows, 1: input columns). `forward` runs each expert on its rows."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, shard_dim: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size, self.shard_dim = tp.rank_in_group, tp.world_size, shard_dim
        sizes = [out_features, in_features]
        sizes[shard_dim] = divide(sizes[shard_dim], self.tp_size, "expert projection features")
        self.weight = frozen_parameter(torch.empty(num_experts, *sizes), self.weight_loader)
        self.packed: list[LinearMethod] | None = None  # per expert, see process_weights_after_loading

    def process_weights_after_loading(self, options: LinearOptions) -> None:
        """Pack every expert's weight for oneDNN where wanted, as the MoE experts do (in batch-invariant mode
        always: F.linear's float32 kernel changes with the number of rows an expert gets)."""
        packs, invariant = options.packs(self.weight.dtype), options.row_invariant
        methods = [cpu_dense_method(w, packs, invariant) for w in self.weight]
        self.packed = methods if methods and methods[0] is not None else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Copy this rank's slice of the checkpoint's stacked [E, out, in] tensor."""
        dim, size = self.shard_dim + 1, param.shape[self.shard_dim + 1]
        full = list(param.shape)
        full[dim] *= self.tp_size
        check_shape(torch.empty(full, device="meta"), loaded, "stacked expert projection")
        param.data.copy_(loaded.narrow(dim, self.tp_rank * size, size))
        self.packed = None  # a new weight: dense until packed again

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [N, in] grouped by expert (counts[e] consecutive rows of expert e) -> [N, out]."""
        out = rows.new_empty(rows.shape[0], self.weight.shape[1])
        start = 0
        for e, count in enumerate(counts):
            if count:
                block = rows[start : start + count]
                packed = None if self.packed is None else self.packed[e]
                out[start : start + count] = F.linear(block, self.weight[e]) if packed is None else packed.apply(
                    self, block, None)
                start += count
        return out


class _FusedKV(MergedColumnParallelLinear):
    """[k | v] of the shared KV heads; the checkpoint stores both as one tensor (JetMoe's kv_proj)."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None) -> None:
        if shard_id is not None:
            super().weight_loader(param, loaded_weight, shard_id)
            return
        for part, half in enumerate(loaded_weight.chunk(2, dim=0)):
            super().weight_loader(param, half, part)


class MixtureOfAttention(nn.Module):
    """Attention whose query and output projections are routed experts (see the module doc)."""

    def __init__(self, arch: DecoderArchConfig, prefix: str = "", reduce_results: bool = True) -> None:
        super().__init__()
        router = arch.attention_experts
        tp = get_tp_group()
        d, self.top_k = arch.head_dim, router.top_k
        self.num_kv_heads = divide(arch.num_kv_heads, tp.world_size, "KV heads of the mixture of attention")
        width, local = arch.num_kv_heads * d, self.num_kv_heads * d
        self.router = Router(router, arch.hidden_size)
        self.q_experts = StackedExpertLinear(router.num_experts, arch.hidden_size, width, shard_dim=0)
        self.o_experts = StackedExpertLinear(router.num_experts, width, arch.hidden_size, shard_dim=1)
        self.kv_proj = _FusedKV(arch.hidden_size, [width, width], False, _join(prefix, "kv_proj"))
        self.bias = None
        if arch.o_proj_bias:
            self.bias = frozen_parameter(torch.empty(arch.hidden_size), self._load_bias)
        self.head_dim, self.local_width = d, local
        self.attn = Attention(
            self.top_k * self.num_kv_heads, d, arch.scale, self.num_kv_heads, prefix=_join(prefix, "attn")
        )
        self.tp_rank, self.reduce = tp.rank_in_group, reduce_results and tp.world_size > 1

    @staticmethod
    def _load_bias(param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_shape(param, loaded, "mixture-of-attention output bias")
        param.data.copy_(loaded)

    def forward(
        self, hidden: torch.Tensor, rope: RotaryCosSin | None, query_scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] (this rank's partial sum when not reducing)."""
        if query_scale is not None:
            raise ValueError("a mixture of attention has no per-position query scale")
        t, k, hkv, d = hidden.shape[0], self.top_k, self.num_kv_heads, self.head_dim
        weights, ids = self.router(hidden)  # [T, k]
        order, counts = group_by_expert(ids, self.router.config.num_experts)  # assignment t * k + j, by expert
        tokens = order // k
        q = torch.empty(t * k, self.local_width, dtype=hidden.dtype, device=hidden.device)
        q[order] = self.q_experts(hidden.index_select(0, tokens), counts)  # [T * k, Hkv * D], row t * k + j
        kv = self.kv_proj(hidden)  # [T, 2 * Hkv * D]
        # heads: expert j's head h -> query head h * k + j, then the KV heads, rotated together
        q_heads = q.view(t, k, hkv, d).transpose(1, 2).reshape(t, hkv * k, d)
        qk = torch.cat([q_heads, kv[:, : hkv * d].view(t, hkv, d)], dim=1)  # [T, Hkv * k + Hkv, D]
        if rope is not None:
            rope.apply_(qk)
        out = self.attn(qk[:, : hkv * k].flatten(1), qk[:, hkv * k :].flatten(1), kv[:, hkv * d :])  # [T, Hkv * k * D]
        per_expert = out.view(t, hkv, k, d).transpose(1, 2).reshape(t * k, hkv * d)  # row t * k + j
        rows = self.o_experts(per_expert.index_select(0, order), counts)  # [T * k, hidden], grouped
        rows.mul_(weights.reshape(-1).index_select(0, order).to(rows.dtype).unsqueeze(1))
        result = torch.zeros_like(hidden).index_add_(0, tokens, rows)
        if self.bias is not None and self.tp_rank == 0:
            result += self.bias
        return get_tp_group().all_reduce(result) if self.reduce else result
