"""Linear layers that shard their weight across the tensor-parallel group.

Each layer owns its `weight_loader(param, loaded_weight[, shard_id])`, which takes the full
checkpoint tensor and copies this rank's slice into place (`_place`); models never slice weights
themselves. Weights are [out_features, in_features] like torch.nn.Linear, created uninitialized (the
loader fills them).

A layer computes through its `quant_method` (see layers/quantization.py): dense by default; after
loading, `process_weights_after_loading` may give it a packed int4 copy of its weight for small
batches. Exact int4 groups (or a bitsandbytes form, layers/bitsandbytes.py) a loader attached to a
checkpoint tensor are placed with the same `_place` as the dense rows, so fused and sharded weights get
theirs in the same order.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.core.errors import ModelLoadError
from llmplug.layers.bitsandbytes import stage_bnb
from llmplug.layers.quantization import DENSE, LinearOptions, LinearMethod, linear_method_for, stage_int4
from llmplug.layers.weight_utils import ShardId, default_weight_loader, frozen_parameter
from llmplug.quantization.base import QuantizedLinearMethod
from llmplug.quantization.context import checkpoint_method_for

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
]


class LoRAHook(Protocol):
    """Adds the LoRA adapters' delta to a layer's output (llmplug.lora.layers.LoRASlots)."""

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] plus each token's adapter delta on x [T, in] (token ids [T] for an embedding; this rank's
        shards of both)."""
        ...


def divide(numerator: int, denominator: int, what: str = "features") -> int:
    """Exact division of `numerator` `what` over `denominator` tensor-parallel ranks; an error naming both otherwise."""
    if numerator % denominator:
        raise ValueError(
            f"{numerator} {what} cannot be split evenly over tensor_parallel_size={denominator} ranks; "
            "choose a tensor-parallel size that divides it"
        )
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T + b with W: [output_size, input_size] (this rank's shard)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, prefix: str = "") -> None:
        super().__init__()
        self.input_size, self.output_size, self.prefix = input_size, output_size, prefix
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.quant_method: LinearMethod = DENSE
        # a quantized checkpoint's layer holds the checkpoint's packed tensors instead of a dense weight
        method = checkpoint_method_for(self, prefix)
        if method is None:
            self.weight = frozen_parameter(torch.empty(output_size, input_size), self.weight_loader)
        else:
            self.register_parameter("weight", None)
            self.quant_method = method
            method.create_weights(self)
        self.bias = frozen_parameter(torch.empty(output_size), self.weight_loader) if bias else None
        self.lora: LoRAHook | None = None  # adapter slots, attached by llmplug.lora when LoRA is enabled

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None) -> None:
        """Copy this rank's part of checkpoint tensor `loaded_weight` (shard `shard_id` of a fused weight) into `param`.

        A new weight invalidates an int4 copy made from the old one: the layer is dense again until
        `process_weights_after_loading` runs.
        """
        self._place(param.data, loaded_weight, shard_id)
        if param is self.weight:
            self.quant_method = DENSE
            place = lambda dst, src: self._place(dst, src, shard_id)  # noqa: E731
            stage_int4(param, loaded_weight, place)
            stage_bnb(param, loaded_weight, place)

    def _place(
        self, dst: torch.Tensor, loaded: torch.Tensor, shard_id: ShardId | None, output_dim: int | None = 0,
        input_dim: int | None = 1, output_pack: int = 1,
    ) -> None:
        """Copy the part of checkpoint tensor `loaded` that this rank holds into `dst` (shaped like the parameter).

        `output_dim` / `input_dim`: the dims of `dst` along the output and input features (None: it has none; a
        bias has no input dim); `output_pack`: output features per entry along `output_dim` (a format that packs
        eight 4-bit zero points of consecutive outputs into one int32 has 8). The layer's kind says which rows
        `shard_id` fills and which part of the checkpoint's rows and columns this rank takes (`_output_slot`,
        `input_split`).
        """
        if output_dim is not None and dst.dim() > output_dim:
            offset, size, index, count = self._output_slot(shard_id)
            if offset % output_pack or size % output_pack:
                raise ModelLoadError(
                    f"{size} output features at offset {offset} do not split into packs of {output_pack}: the layer's "
                    "shards cannot be placed in the checkpoint's packed form (choose another tensor_parallel_size)"
                )
            dst = dst.narrow(output_dim, offset // output_pack, size // output_pack)
            loaded = _shard(loaded, output_dim, index, size // output_pack, count)
        else:
            _no_shard_id(self, shard_id)
        rank, ranks = self.input_split
        if input_dim is not None and ranks > 1 and dst.dim() > input_dim:
            loaded = _shard(loaded, input_dim, rank, dst.shape[input_dim], ranks)
        default_weight_loader(dst, loaded)

    def _output_slot(self, shard_id: ShardId | None) -> tuple[int, int, int, int]:
        """Where `shard_id`'s rows go and come from: (offset, size) in this rank's output features, and (index,
        count): this rank takes slice `index` of `count` equal slices of the checkpoint tensor's rows. Here: all."""
        _no_shard_id(self, shard_id)
        return 0, self.output_size, 0, 1

    @property
    def input_split(self) -> tuple[int, int]:
        """(index, count): this rank takes slice `index` of `count` equal slices of the input features."""
        return 0, 1

    def create_parameter(
        self, name: str, shape: Sequence[int], dtype: torch.dtype, output_dim: int | None, input_dim: int | None,
        output_pack: int = 1,
    ) -> nn.Parameter:
        """Register an uninitialized parameter of a quantized checkpoint's form (see `_place` for the dims), loaded
        with this layer's sharding; its `weight_loader` takes the checkpoint tensor (and the fused shard id)."""

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
            if loaded.dtype != param.dtype:
                raise ModelLoadError(f"{name} is {loaded.dtype} in the checkpoint; {type(self.quant_method).__name__} "
                                     f"expects {param.dtype}")
            self._place(param.data, loaded, shard_id, output_dim, input_dim, output_pack)

        param = frozen_parameter(torch.empty(*shape, dtype=dtype), load)
        self.register_parameter(name, param)
        return param

    def process_weights_after_loading(self, options: LinearOptions) -> None:
        """Choose the quant method now that the weight (and any staged int4 groups) are loaded; a quantized
        checkpoint's method repacks its tensors for its kernel (fp8's is named `weight`, as in the checkpoint)."""
        if self.weight is None or isinstance(self.quant_method, QuantizedLinearMethod):
            self.quant_method.process_weights_after_loading(self, options)
        else:
            self.quant_method = linear_method_for(self.weight, options)

    def use_quantized(self, method: LinearMethod, weight: nn.Parameter) -> None:
        """Compute through `method` from now on; its quantized `weight` replaces (and frees) the dense one."""
        self.quant_method, self.weight = method, weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., input_size] -> [..., output_size]."""
        y = self.quant_method.apply(self, x, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, tp={self.tp_size}, "
            f"method={self.quant_method!r}"
        )


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: each rank holds rows [rank * n, (rank + 1) * n) of W."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False, prefix: str = ""
    ) -> None:
        self.total_output_size, self.gather_output = output_size, gather_output
        super().__init__(input_size, divide(output_size, get_tp_group().world_size), bias, prefix)

    def _output_slot(self, shard_id: ShardId | None) -> tuple[int, int, int, int]:
        """This rank's rows of the full [output_size, ...] tensor."""
        _no_shard_id(self, shard_id)
        return 0, self.output_size, self.tp_rank, self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., input_size] -> [..., output_size / tp] (or whole with gather_output)."""
        y = self.quant_method.apply(self, x, self.bias)
        if self.lora is not None:
            y = self.lora.apply(x, y)
        return get_tp_group().all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (e.g. gate and up).

    Checkpoint tensors load as shards 0, 1, ... of `output_sizes`; each rank's weight is
    [shard 0 rows of this rank; shard 1 rows of this rank; ...].
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = True, prefix: str = "") -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(self.output_sizes), bias, gather_output=False, prefix=prefix)

    def _output_slot(self, shard_id: ShardId | None) -> tuple[int, int, int, int]:
        """This rank's rows of checkpoint projection `shard_id`, at its place in the fused weight."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"MergedColumnParallelLinear shard id must be 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        sizes = [divide(s, self.tp_size) for s in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id], self.tp_rank, self.tp_size


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
        self.num_heads = divide(total_num_heads, tp_size, "attention heads")
        if tp_size >= total_num_kv_heads:
            if tp_size % total_num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size={tp_size} is not a multiple of the model's {total_num_kv_heads} KV heads, "
                    "so they cannot be replicated evenly over the ranks"
                )
            self.num_kv_heads, self.num_kv_head_replicas = 1, tp_size // total_num_kv_heads
        else:
            self.num_kv_heads, self.num_kv_head_replicas = divide(total_num_kv_heads, tp_size, "KV heads"), 1
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

    def _output_slot(self, shard_id: ShardId | None) -> tuple[int, int, int, int]:
        """This rank's heads of checkpoint projection `shard_id` ("q", "k" or "v")."""
        offsets = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        if shard_id not in offsets:
            raise ValueError(f"QKVParallelLinear shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank, self.tp_size
        replicas = self.num_kv_head_replicas
        return offsets[shard_id], self.kv_size, self.tp_rank // replicas, self.tp_size // replicas


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

    @property
    def input_split(self) -> tuple[int, int]:
        """This rank's columns of the weight (int4 groups: their columns of groups); the output (bias) is whole."""
        return self.tp_rank, self.tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., input_size / tp] (or whole) -> [..., output_size], summed over ranks."""
        if not self.input_is_parallel:
            x = x.narrow(-1, self.tp_rank * self.input_size, self.input_size)
        # the bias is added once, by rank 0, so the all-reduce does not count it tp times
        bias = self.bias if self.tp_rank == 0 else None
        y = self.quant_method.apply(self, x, bias)
        if self.lora is not None:  # a partial delta of this rank's columns; the all-reduce sums them
            y = self.lora.apply(x, y)
        return get_tp_group().all_reduce(y) if self.reduce_results and self.tp_size > 1 else y


def _no_shard_id(layer: nn.Module, shard_id: ShardId | None) -> None:
    """A layer loaded whole takes no shard id; one given means the model's name map is wrong."""
    if shard_id is not None:
        raise ValueError(f"{type(layer).__name__} is not a fused layer: it takes no shard id (got {shard_id!r})")


def _shard(loaded: torch.Tensor, dim: int, index: int, size: int, num_shards: int) -> torch.Tensor:
    """Slice `index` of `num_shards` equal slices of `size` along `dim`; the full length must match exactly."""
    if loaded.dim() <= dim or loaded.shape[dim] != size * num_shards:
        raise ModelLoadError(
            f"tensor of shape {tuple(loaded.shape)} should have {size * num_shards} entries along dim {dim}; "
            "the checkpoint does not match its config"
        )
    return loaded.narrow(dim, index * size, size)
