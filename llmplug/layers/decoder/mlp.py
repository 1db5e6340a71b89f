"""The feed-forward block of the generic decoder, gated or not, sharded over the tensor-parallel ranks."""

from __future__ import annotations

import torch
from torch import nn

from llmplug.layers.activation import XIELU, Activation, gated_activation
from llmplug.layers.decoder.arch import MLPConfig
from llmplug.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear

__all__ = ["DecoderMLP"]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class DecoderMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul, or down(act(up(x))).

    Each rank holds a slice of the intermediate features; `down_proj` sums the ranks' partial outputs
    unless `reduce_results=False` (a parallel-residual layer sums attention and MLP in one all-reduce).
    """

    def __init__(
        self, config: MLPConfig, hidden_size: int, intermediate_size: int, prefix: str = "", reduce_results: bool = True
    ) -> None:
        super().__init__()
        inter, bias = intermediate_size, config.bias
        if config.gated:
            self.gate_up_proj = MergedColumnParallelLinear(
                hidden_size, [inter, inter], bias, _join(prefix, "gate_up_proj")
            )
            self.act_fn = gated_activation(config.activation)
        else:
            self.up_proj = ColumnParallelLinear(hidden_size, inter, bias, prefix=_join(prefix, "up_proj"))
            self.act_fn = XIELU() if config.activation == "xielu" else Activation(config.activation)
        down_bias = bias if config.down_bias is None else config.down_bias
        self.down_proj = RowParallelLinear(
            inter, hidden_size, down_bias, reduce_results=reduce_results, prefix=_join(prefix, "down_proj")
        )
        self.gated = config.gated
        self.gate_multiplier, self.down_multiplier = config.gate_multiplier, config.down_multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        up = self.gate_up_proj(x) if self.gated else self.up_proj(x)  # [T, (2 *) inter / tp]
        if self.gate_multiplier != 1.0:
            up[:, : up.shape[-1] // 2].mul_(self.gate_multiplier)  # the gate half
        out = self.down_proj(self.act_fn(up))  # [T, inter / tp] -> [T, hidden]
        return out.mul_(self.down_multiplier) if self.down_multiplier != 1.0 else out
