"""Linear layers that shard their weight across the tensor-parallel group.

Each layer owns its `weight_loader(param, loaded_weight[, shard_id])`, which takes the full
checkpoint tensor and copies this rank's slice into place; models never slice weights themselves.
Weights are [out_features, in_features] like torch.nn.Linear, created uninitialized (the loader
fills them).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.core.errors import ModelLoadError
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
]


def divide(numerator: int, denominator: int) -> int:
    """Exact division; an error naming both numbers otherwise."""
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T + b with W: [output_size, input_size] (this rank's shard)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, prefix: str = "") -> None:
        super().__init__()
        self.input_size, self.output_size, self.prefix = input_size, output_size, prefix
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.weight = frozen_parameter(torch.empty(output_size, input_size), self.weight_loader)
        self.bias = frozen_parameter(torch.empty(output_size), self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy the whole tensor (replicated layers)."""
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., input_size] -> [..., output_size]."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, tp={self.tp_size}"


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: each rank holds rows [rank * n, (rank + 1) * n) of W."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False, prefix: str = ""
    ) -> None:
        self.total_output_size, self.gather_output = output_size, gather_output
        super().__init__(input_size, divide(output_size, get_tp_group().world_size), bias, prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's rows of the full [output_size, ...] tensor."""
        size = param.shape[0]
        default_weight_loader(param, _shard(loaded_weight, 0, self.tp_rank, size, self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., input_size] -> [..., output_size / tp] (or whole with gather_output)."""
        y = F.linear(x, self.weight, self.bias)
        return get_tp_group().all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (e.g. gate and up).

    Checkpoint tensors load as shards 0, 1, ... of `output_sizes`; each rank's weight is
    [shard 0 rows of this rank; shard 1 rows of this rank; ...].
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = True, prefix: str = "") -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, gather_output=False, prefix=prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        """Copy this rank's rows of checkpoint projection `shard_id` into its place in the fused weight."""
        sizes = [divide(s, self.tp_size) for s in self.output_sizes]
        offset, size = sum(sizes[:shard_id]), sizes[shard_id]
        shard = _shard(loaded_weight, 0, self.tp_rank, size, self.tp_size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q, k, v projection: output [q heads | k heads | v heads] of this rank.

    With fewer KV heads than ranks, each KV head is replicated on tp / num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        prefix: str = "",
    ) -> None:
        tp_size = get_tp_group().world_size
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads, self.num_kv_head_replicas = divide(total_num_kv_heads, tp_size), 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias, gather_output=False, prefix=prefix)

    @property
    def q_size(self) -> int:
        """Width of this rank's q output."""
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of this rank's k (and of its v) output."""
        return self.num_kv_heads * self.head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str) -> None:
        """Copy this rank's heads of checkpoint projection `shard_id` ("q", "k" or "v")."""
        offsets = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        if shard_id not in offsets:
            raise ValueError(f"QKVParallelLinear shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        if shard_id == "q":
            size, index, num_shards = self.q_size, self.tp_rank, self.tp_size
        else:
            replicas = self.num_kv_head_replicas
            size, index, num_shards = self.kv_size, self.tp_rank // replicas, self.tp_size // replicas
        dst = param.data.narrow(0, offsets[shard_id], size)
        default_weight_loader(dst, _shard(loaded_weight, 0, index, size, num_shards))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        prefix: str = "",
    ) -> None:
        self.total_input_size = input_size
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        super().__init__(divide(input_size, get_tp_group().world_size), output_size, bias, prefix)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's columns of the weight; the bias is loaded whole."""
        if param.dim() == 1:
            default_weight_loader(param, loaded_weight)
            return
        size = param.shape[1]
        default_weight_loader(param, _shard(loaded_weight, 1, self.tp_rank, size, self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., input_size / tp] (or whole) -> [..., output_size], summed over ranks."""
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp_rank * self.input_size, self.input_size)
        # the bias is added once, by rank 0, so the all-reduce does not count it tp times
        bias = self.bias if self.tp_rank == 0 else None
        y = F.linear(x, self.weight, bias)
        return get_tp_group().all_reduce(y) if self.reduce_results and self.tp_size > 1 else y


def _shard(loaded: torch.Tensor, dim: int, index: int, size: int, num_shards: int) -> torch.Tensor:
    """Slice `index` of `num_shards` equal slices of `size` along `dim`; the full length must match exactly."""
    if loaded.dim() <= dim or loaded.shape[dim] != size * num_shards:
        raise ModelLoadError(
            f"tensor of shape {tuple(loaded.shape)} should have {size * num_shards} entries along dim {dim}; "
            "the checkpoint does not match its config"
        )
    return loaded.narrow(dim, index * size, size)
