"""The stacking projector (Ultravox's `multi_modal_projector`): an audio encoder's states [frames, d] -> the language
model's embeddings [ceil(frames / stack_factor), text_hidden].

Each `stack_factor` consecutive states are joined into one row (the last row zero-padded), then RMSNorm (`ln_pre`),
`linear_1`, SwiGLU (`x, gate` = the two halves, `silu(gate) * x`: the gate second) or a plain activation, and
`linear_2`, with one more RMSNorm after the activation (`ln_mid`, Ultravox 0.5 and later) or after `linear_2`
(`ln_post`, before). All layers bias-free and replicated (its output is merged into every rank's embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.activation import Activation
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.weight_utils import load_mapped_weights

__all__ = ["SWIGLU", "StackingProjector", "StackingProjectorConfig"]

SWIGLU = "swiglu"  # the activation name that halves linear_1's output


@dataclass(frozen=True, slots=True)
class StackingProjectorConfig:
    """The projector's shape: encoder width, stacking, its own width (`linear_1`'s output) and the decoder's."""

    encoder_hidden: int
    text_hidden: int
    hidden_size: int  # linear_1's output features (halved by SwiGLU)
    stack_factor: int
    activation: str  # "swiglu" or a name of llmplug.layers.activation.ACTIVATIONS
    norm_mid: bool  # RMSNorm after the activation (True) or after linear_2 (False)
    eps: float = 1e-6


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class StackingProjector(nn.Module):
    """[frames, encoder_hidden] -> [ceil(frames / stack_factor), text_hidden]."""

    def __init__(self, config: StackingProjectorConfig, prefix: str = "") -> None:
        super().__init__()
        c = config
        self.stack_factor = c.stack_factor
        dim_in = c.encoder_hidden * c.stack_factor
        self.gated = c.activation == SWIGLU
        if self.gated and c.hidden_size % 2:
            raise ValueError(f"a SwiGLU projector splits its {c.hidden_size} features in halves: use an even size")
        dim_mid = c.hidden_size // 2 if self.gated else c.hidden_size
        self.ln_pre = RMSNorm(dim_in, c.eps)
        self.linear_1 = ReplicatedLinear(dim_in, c.hidden_size, bias=False, prefix=_join(prefix, "linear_1"))
        self.act = Activation("silu" if self.gated else c.activation)
        self.ln_mid = RMSNorm(dim_mid, c.eps) if c.norm_mid else nn.Identity()
        self.linear_2 = ReplicatedLinear(dim_mid, c.text_hidden, bias=False, prefix=_join(prefix, "linear_2"))
        self.ln_post = nn.Identity() if c.norm_mid else RMSNorm(c.text_hidden, c.eps)

    def stack(self, states: torch.Tensor) -> torch.Tensor:
        """[frames, d] -> [ceil(frames / stack_factor), d * stack_factor], consecutive states side by side."""
        frames, width = states.shape
        padded = -(-frames // self.stack_factor) * self.stack_factor
        return F.pad(states, (0, 0, 0, padded - frames)).reshape(padded // self.stack_factor, width * self.stack_factor)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(self.ln_pre(self.stack(states)))  # [tokens, hidden_size]
        if self.gated:
            x, gate = x.chunk(2, dim=-1)
            x = self.act(gate) * x
        else:
            x = self.act(x)
        return self.ln_post(self.linear_2(self.ln_mid(x)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `ln_pre.weight`, `linear_1.weight`, `ln_mid.weight` or `ln_post.weight`, `linear_2.weight`."""
        return load_mapped_weights(self, weights)
