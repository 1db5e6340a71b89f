"""The routed experts of a mixture-of-experts layer, stacked, computed by grouping tokens per expert.

Weights are stacked tensors (transformers' own in-memory layout):

    gate_up_proj [E_local, 2 * I_local, hidden]   rows: [gate of this rank | up of this rank]
    down_proj    [E_local, hidden, I_local]
    gate_up_proj_bias [E_local, 2 * I_local], down_proj_bias [E_local, hidden]   (optional)

Tensor parallelism (default) shards every expert's intermediate features: E_local = E and
I_local = I / tp, and each rank's output is a partial sum (the caller all-reduces once). Expert
parallelism gives each rank E / tp whole experts (I_local = I); tokens routed to another rank's
expert contribute nothing here, so the same single all-reduce completes the sum.

Checkpoint tensors arrive one expert and projection at a time (`weight_loader` with shard id
`ExpertShard(expert, part)`, part 0 gate or down, 1 up); stacked checkpoint layouts are split into
such pieces before (llmplug.layers.checkpoint_names, EXPERTS*).

Compute: the (token, expert) assignments are sorted by expert (stable; on a GPU by the Triton kernel
`moe_align_block_size`, llmplug.layers.kernels), so each expert's tokens are one contiguous block of
rows; each expert with at least one token runs two matmuls over its block, and the weighted rows
are summed back per token with one index_add. No Python loop over tokens. On CPU in bf16 / fp16
each expert's weights are packed once after loading into oneDNN's layout (as dense layers are,
llmplug.layers.packed_linear): an expert sees a few rows per step, where F.linear's per-call
reorder of the weight costs as much as the matmul. A new weight drops the packed copies.

A quantized checkpoint's experts (after vLLM's FusedMoEMethodBase): the checkpoint's method gives the layer a
`QuantizedExpertsMethod` as it is built (`experts_method_for`, as linear layers get theirs), which registers the
checkpoint's tensors stacked over the experts with `create_parameter` (`...experts.<e>.gate_proj.<leaf>` loads
into `gate_up_proj_<leaf>`, `weight` into `gate_up_proj` itself), repacks them once after loading, and computes
each expert's two projections on its block of rows (`quant_method.apply`); biases stay dense.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.core.errors import ModelLoadError
from llmplug.layers.activation import ClampedSwiGLU, gated_activation
from llmplug.layers.kernels import use_triton
from llmplug.layers.linear import divide
from llmplug.layers.moe.config import MoEConfig
from llmplug.layers.packed_linear import cpu_dense_method
from llmplug.layers.quantization import DENSE, DenseLinearMethod, LinearMethod, LinearOptions
from llmplug.layers.weight_utils import ExpertParamsMap, ExpertShard, ShardId, check_shape, frozen_parameter
from llmplug.quantization.base import QuantizedExpertsMethod
from llmplug.quantization.context import experts_method_for

__all__ = ["EXPERT_PARAMS", "FusedExperts", "group_by_expert"]

# checkpoint `...experts.<e>.<name>` -> (the stacked parameter of FusedExperts, part of it)
EXPERT_PARAMS: ExpertParamsMap = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """The flat assignments of expert ids [T, k] sorted by expert (stable) [T * k], and each expert's
    count; one Triton kernel on a GPU (`use_triton`)."""
    if use_triton(ids):
        from llmplug.layers.kernels.moe_align import moe_align_block_size

        order, _, counts = moe_align_block_size(ids, num_experts)
        return order, counts.tolist()
    flat_ids = ids.reshape(-1)
    return flat_ids.argsort(stable=True), torch.bincount(flat_ids, minlength=num_experts).tolist()


class FusedExperts(nn.Module):
    """Every routed expert's gated MLP, down(act(gate(x)) * up(x)), as stacked tensors (see the module doc)."""

    def __init__(self, config: MoEConfig, hidden_size: int, expert_parallel: bool = False, prefix: str = "") -> None:
        super().__init__()
        self.prefix, self.hidden_size = prefix, hidden_size
        tp = get_tp_group()
        self.tp_rank, self.tp_size, self.expert_parallel = tp.rank_in_group, tp.world_size, expert_parallel
        self.num_experts = config.num_experts
        if expert_parallel:
            self.num_local_experts = divide(config.num_experts, self.tp_size, "experts")
            self.intermediate_size = config.intermediate_size
        else:
            self.num_local_experts = config.num_experts
            self.intermediate_size = divide(config.intermediate_size, self.tp_size, "expert intermediate features")
        self.weights_on_input = config.router.weights_on_input
        self.first_expert = self.tp_rank * self.num_local_experts if expert_parallel else 0
        e, i, h = self.num_local_experts, self.intermediate_size, hidden_size
        # DENSE: the stacked weights below; else a quantized checkpoint's method holds its own tensors
        self.quant_method: QuantizedExpertsMethod | DenseLinearMethod = DENSE
        method = experts_method_for(self, prefix)
        if method is None:
            self.gate_up_proj = self._stacked(torch.empty(e, 2 * i, h), parts=2)
            self.down_proj = self._stacked(torch.empty(e, h, i), parts=1)
        else:
            self.register_parameter("gate_up_proj", None)  # the method's tensors (fp8's weight takes the name)
            self.register_parameter("down_proj", None)
            self.quant_method = method
            method.create_weights(self)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if config.expert_bias:
            self.gate_up_proj_bias = self._stacked(torch.empty(e, 2 * i), parts=2)
            self.down_proj_bias = self._stacked(torch.empty(e, h), parts=1)
        self.act_fn = (
            gated_activation(config.activation)
            if config.swiglu_limit is None
            else ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)
        )
        # per local expert (gate_up, down) packed for oneDNN; None: F.linear on the dense weights
        self.packed: list[tuple[LinearMethod, LinearMethod]] | None = None

    def _stacked(self, data: torch.Tensor, parts: int) -> nn.Parameter:
        param = frozen_parameter(data, self.weight_loader)
        param.expected_shards = frozenset(ExpertShard(e, p) for e in range(self.num_experts) for p in range(parts))
        return param

    def create_parameter(
        self, name: str, projection: str, shape: tuple[int, ...], dtype: torch.dtype, output_dim: int | None,
        input_dim: int | None,
    ) -> nn.Parameter:
        """Register a quantized checkpoint's tensor stacked over the local experts, [E_local, *shape] (`shape`: one
        expert's `projection`, "gate_up_proj" or "down_proj", on this rank); its loader takes each expert's
        checkpoint tensor and places this rank's part: gate and up rows at the two halves of `output_dim`, down's
        `input_dim` sliced for tensor parallelism (None: the tensor has no such dim; packed dims are sized packed)."""
        where = f"{self.prefix}.{name}"

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
            local = self.local_expert(shard_id)
            if local is None:
                return
            if loaded.dtype != param.dtype:
                raise ModelLoadError(f"{where} is {loaded.dtype} in the checkpoint; "
                                     f"{type(self.quant_method).__name__} expects {param.dtype}")
            dst = param.data[local]
            if projection == "gate_up_proj" and output_dim is not None:
                size = dst.shape[output_dim] // 2
                _copy_slice(dst.narrow(output_dim, shard_id.part * size, size), loaded, output_dim, self.slice_index)
            elif projection == "down_proj" and input_dim is not None:
                _copy_slice(dst, loaded, input_dim, self.slice_index)
            else:
                check_shape(dst, loaded, where)
                dst.copy_(loaded)

        param = self._stacked(torch.empty(self.num_local_experts, *shape, dtype=dtype),
                              parts=2 if projection == "gate_up_proj" else 1)
        param.weight_loader = load  # type: ignore[attr-defined]
        self.register_parameter(name, param)
        return param

    def local_expert(self, shard_id: ShardId | None) -> int | None:
        """The local index of shard `ExpertShard(expert, part)`'s expert; None: another rank's (expert parallelism)."""
        if not isinstance(shard_id, ExpertShard):
            raise ValueError(
                f"stacked expert weights load one expert at a time (shard id ExpertShard), got {shard_id!r}"
            )
        local = shard_id.expert - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Copy this rank's part of one expert's checkpoint projection (shard `ExpertShard(expert, part)`)."""
        local = self.local_expert(shard_id)
        if local is None:
            return
        self.packed = None  # never compute with a stale copy
        dst = param.data[local]
        if param is self.gate_up_proj or param is self.gate_up_proj_bias:
            size = self.intermediate_size
            _copy_slice(dst.narrow(0, shard_id.part * size, size), loaded, 0, self.slice_index)
        elif param is self.down_proj:
            _copy_slice(dst, loaded, 1, self.slice_index)
        else:  # down_proj_bias: whole (added by one rank only)
            check_shape(dst, loaded, "expert down_proj bias")
            dst.copy_(loaded)

    def process_weights_after_loading(self, options: LinearOptions) -> None:
        """Pack every local expert's weights for oneDNN where that is supported and wanted (options.prepack); in
        batch-invariant mode call them by their row plans (layers/packed_linear.py); a quantized checkpoint's method
        repacks its tensors."""
        if self.quant_method is not DENSE:
            self.quant_method.process_weights_after_loading(self, options)
            return
        packs, invariant = options.packs(self.gate_up_proj.dtype), options.row_invariant
        methods = [
            (cpu_dense_method(self.gate_up_proj[e], packs, invariant), cpu_dense_method(self.down_proj[e], packs, invariant))
            for e in range(self.num_local_experts)
        ]
        self.packed = methods if methods and methods[0][0] is not None else None  # None: plain F.linear

    @property
    def slice_index(self) -> tuple[int, int]:
        """(this rank's slice, slices) of each expert's intermediate features."""
        return (0, 1) if self.expert_parallel else (self.tp_rank, self.tp_size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], routing weights [T, k] and expert ids [T, k] -> sum over k of weight * expert(x)
        [T, hidden] (this rank's partial sum); with the router's `weights_on_input`, of expert(weight * x)."""
        weights_on_input = self.weights_on_input
        num_tokens, top_k = ids.shape
        order, counts = group_by_expert(ids, self.num_experts)
        tokens = order // top_k  # token of each grouped assignment
        rows = x.index_select(0, tokens)  # [T * k, hidden]
        row_weights = weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)  # [T * k, 1]
        if weights_on_input:
            rows = rows * row_weights
        out = rows.new_zeros(rows.shape) if self.expert_parallel else torch.empty_like(rows)
        start = sum(counts[: self.first_expert])
        for local, count in enumerate(counts[self.first_expert : self.first_expert + self.num_local_experts]):
            if count:
                block = slice(start, start + count)
                out[block] = self._expert(local, rows[block])
                start += count
        if not weights_on_input:
            out.mul_(row_weights)
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert `e` on its rows x [n, hidden] -> [n, hidden] (down bias on one rank only)."""
        gate_up_bias = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
        down_bias = None
        if self.down_proj_bias is not None and (self.expert_parallel or self.tp_rank == 0):
            down_bias = self.down_proj_bias[e]
        if self.quant_method is not DENSE:
            hidden = self.act_fn(_biased(self.quant_method.apply(self, e, "gate_up_proj", x), gate_up_bias))
            return _biased(self.quant_method.apply(self, e, "down_proj", hidden), down_bias)
        if self.packed is not None:
            gate_up, down = self.packed[e]
            hidden = self.act_fn(gate_up.apply(self, x, gate_up_bias))  # [n, I_local]
            return down.apply(self, hidden, down_bias)
        hidden = self.act_fn(F.linear(x, self.gate_up_proj[e], gate_up_bias))  # [n, I_local]
        return F.linear(hidden, self.down_proj[e], down_bias)

    def extra_repr(self) -> str:
        mode = "expert" if self.expert_parallel else "tensor"
        return (
            f"experts={self.num_experts}, local={self.num_local_experts}, intermediate={self.intermediate_size}, "
            f"parallel={mode}" + ("" if self.quant_method is DENSE else f", method={self.quant_method!r}")
        )


def _biased(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def _copy_slice(dst: torch.Tensor, loaded: torch.Tensor, dim: int, index: tuple[int, int]) -> None:
    """Copy slice `index` = (i, n) of n equal slices of `loaded` along `dim` into `dst` (shaped like one slice)."""
    i, n = index
    full = list(dst.shape)
    full[dim] *= n
    check_shape(torch.empty(full, device="meta"), loaded, "expert weight")
    dst.copy_(loaded.narrow(dim, i * dst.shape[dim], dst.shape[dim]))
