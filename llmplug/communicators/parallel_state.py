"""Process groups of tensor parallelism, as the layers see them.

Minimal single-process version: `get_tp_group()` returns a group of one rank whose collectives are
identities. The parallel linear and embedding layers read their rank and group size from it (never
assume 1), so the distributed implementation can replace this module without touching them.
"""

from __future__ import annotations

import torch

__all__ = ["GroupCoordinator", "get_tp_group", "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"]


class GroupCoordinator:
    """A process group of one rank: every collective returns its input."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rank_in_group = 0
        self.world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum across the group (one rank: the tensor itself)."""
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor along `dim` (one rank: the tensor itself)."""
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum across the group and keep this rank's slice along `dim` (one rank: the tensor itself)."""
        return tensor

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate along `dim` on rank `dst` (one rank: the tensor itself)."""
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy rank `src`'s tensor to every rank (one rank: the tensor itself)."""
        return tensor

    def barrier(self) -> None:
        """Wait for every rank (one rank: nothing to wait for)."""


_TP = GroupCoordinator("tp")


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group of this process."""
    return _TP


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in the tensor-parallel group."""
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks in the tensor-parallel group."""
    return get_tp_group().world_size
