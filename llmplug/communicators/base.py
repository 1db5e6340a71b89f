"""TorchDistributedCommunicator: the collectives of one process group through torch.distributed.

It implements the `Communicator` protocol with the operations every torch.distributed backend has
(list all-gather, all-reduce, gather, broadcast, send/recv), so it runs on gloo, NCCL or any other
backend as is. A platform's communicator (`llmplug.communicators` entry point, named by
`Platform.get_communicator()`) subclasses it where its backend has something faster.

Ranks given to the methods (`dst`, `src`) are ranks *in the group*; torch.distributed wants global
ranks, which `ranks[i]` translates.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["TorchDistributedCommunicator"]


class TorchDistributedCommunicator:
    """Collectives of one group: tensors over `device_group`, barriers over the gloo `cpu_group`."""

    def __init__(
        self,
        device_group: dist.ProcessGroup,
        cpu_group: dist.ProcessGroup,
        ranks: Sequence[int],
        device: torch.device,
    ) -> None:
        self.device_group, self.cpu_group = device_group, cpu_group
        self.ranks = list(ranks)
        self.device = device
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(dist.get_rank())

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum across the group; the input's storage is reused for the result (callers pass a fresh tensor)."""
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor (all the same shape) along `dim`."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum across the group, then keep this rank's 1/world_size slice along `dim`."""
        size = tensor.shape[dim] // self.world_size
        if size * self.world_size != tensor.shape[dim]:
            raise ValueError(
                f"reduce_scatter: dim {dim} of shape {tuple(tensor.shape)} does not split into {self.world_size} ranks"
            )
        total = self.all_reduce(tensor.clone())
        return total.narrow(dim, self.rank_in_group * size, size).contiguous()

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate along `dim` on group rank `dst`; the other ranks get None."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.rank_in_group == dst else None
        dist.gather(tensor, parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy group rank `src`'s tensor into every rank's `tensor` (same shape and dtype everywhere)."""
        dist.broadcast(tensor, src=self.ranks[src], group=self.device_group)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to group rank `dst` (which calls `recv` with its size and dtype)."""
        dist.send(tensor.contiguous(), dst=self.ranks[dst], group=self.device_group)

    def recv(self, size: Any, dtype: torch.dtype, src: int) -> torch.Tensor:
        """Receive a tensor of `size` and `dtype` from group rank `src`."""
        tensor = torch.empty(size, dtype=dtype, device=self.device)
        dist.recv(tensor, src=self.ranks[src], group=self.device_group)
        return tensor

    def barrier(self) -> None:
        """Wait for every rank of the group, on the CPU group (a device barrier would need a device sync)."""
        dist.barrier(group=self.cpu_group)
