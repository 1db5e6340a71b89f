"""LFM2's short-convolution mixer: gated depthwise causal conv.

in_proj -> (B, C, x); y = C * conv(B * x); out_proj(y). No activation. Per-request state: the conv
window [hidden, kernel - 1]. Parameter names are transformers' (`in_proj`, `conv`, `out_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.recurrent.causal_conv import CausalConv1d
from llmplug.layers.recurrent.state import RecurrentMixer, StateShape

__all__ = ["ShortConv", "ShortConvConfig"]


@dataclass(frozen=True, slots=True)
class ShortConvConfig:
    """LFM2's conv layers: kernel size (`conv_L_cache`) and bias (on the conv and both projections)."""

    kernel: int
    bias: bool = False


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class ShortConv(RecurrentMixer):
    """Gated short convolution over the flattened step."""

    def __init__(self, config: ShortConvConfig, hidden_size: int, prefix: str = "") -> None:
        super().__init__()
        self.in_proj = ReplicatedLinear(hidden_size, 3 * hidden_size, config.bias, _join(prefix, "in_proj"))
        self.conv = CausalConv1d(hidden_size, config.kernel, config.bias)
        self.out_proj = ReplicatedLinear(hidden_size, hidden_size, config.bias, _join(prefix, "out_proj"))

    def state_shapes(self) -> tuple[StateShape, ...]:
        return (StateShape(self.conv.window_shape),)

    def project_in(self, hidden: torch.Tensor) -> torch.Tensor:
        B, C, x = self.in_proj(hidden).chunk(3, dim=-1)
        return torch.cat([B * x, C], dim=-1)  # [T, Bx | C]

    def mix_steps(self, x: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        bx, c = x.chunk(2, dim=-1)
        y, window = self.conv.step(bx, self.read_state(0, slots, has_state))
        self.write_state(0, slots, window)
        return c * y

    def mix_chunks(
        self, x: torch.Tensor, lens: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor
    ) -> torch.Tensor:
        bx, c = x.chunk(2, dim=-1)
        y, window = self.conv.prefill(bx, lens, self.read_state(0, slots, has_state))
        self.write_state(0, slots, window)
        return c * y

    def project_out(self, y: torch.Tensor) -> torch.Tensor:
        return self.out_proj(y)
