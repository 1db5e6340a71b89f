"""The CUDA communicator: NCCL through torch.distributed, with NCCL's single-buffer collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmplug.communicators.base import TorchDistributedCommunicator

__all__ = ["CudaCommunicator"]

# torch 2.13 renamed the single-buffer collectives (the old names warn); older torch has only the old ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CudaCommunicator(TorchDistributedCommunicator):
    """NCCL gathers into and scatters from one contiguous buffer instead of a list of tensors."""

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor along `dim` (one NCCL all-gather along dim 0)."""
        dim = dim % tensor.dim()
        out = tensor.new_empty((self.world_size * tensor.shape[0], *tensor.shape[1:]))
        _all_gather_single(out, tensor.contiguous(), group=self.device_group)
        if dim == 0:
            return out
        # [world * d0, ...] -> [world, d0, ..., d_dim, ...] -> [d0, ..., world * d_dim, ...]
        stacked = out.view(self.world_size, *tensor.shape).movedim(0, dim)
        return stacked.reshape(*tensor.shape[:dim], -1, *tensor.shape[dim + 1 :])

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum across the group and keep this rank's slice along `dim` (one NCCL reduce-scatter)."""
        dim = dim % tensor.dim()
        if tensor.shape[dim] % self.world_size:
            raise ValueError(
                f"reduce_scatter: dim {dim} of shape {tuple(tensor.shape)} does not split into {self.world_size} ranks"
            )
        # NCCL scatters along dim 0: bring `dim` to the front and back
        chunks = tensor.movedim(dim, 0).contiguous()
        out = chunks.new_empty((chunks.shape[0] // self.world_size, *chunks.shape[1:]))
        _reduce_scatter_single(out, chunks, group=self.device_group)
        return out.movedim(0, dim).contiguous()
