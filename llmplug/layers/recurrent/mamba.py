"""Mamba's mixer (Mamba, FalconMamba, Jamba): gated selective SSM after a short causal convolution.

in_proj -> (x, z); x -> causal conv -> act; x_proj(x) -> (dt, B, C) [optionally RMS-normed];
dt = softplus(dt_proj(dt)); y = scan(x, dt, A = -exp(A_log), B, C) + D x; out_proj(y * silu(z)).
Per-request state: the conv window [intermediate, kernel - 1] and the SSM state [intermediate, state]
(float32). Parameter names are transformers' (`in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`,
`out_proj`, Jamba's `dt_layernorm`, `b_layernorm`, `c_layernorm`). Every rank holds the whole mixer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from llmplug.layers.activation import activation_fn
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.recurrent.causal_conv import CausalConv1d
from llmplug.layers.recurrent.selective_scan import selective_scan, selective_state_update
from llmplug.layers.recurrent.state import RecurrentMixer, StateShape
from llmplug.layers.rowwise import rowwise
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["MambaMixer", "MambaMixerConfig"]


@dataclass(frozen=True, slots=True)
class MambaMixerConfig:
    """Sizes and variants of a Mamba (1) mixer."""

    intermediate_size: int
    state_size: int
    conv_kernel: int
    time_step_rank: int
    conv_bias: bool = True
    proj_bias: bool = False  # on in_proj and out_proj
    activation: str = "silu"  # after the conv
    # RMS norms of dt, B and C before the scan: weightless (FalconMamba) or with weights (Jamba)
    dt_bc_norm: Literal["weightless", "weighted"] | None = None
    dt_bc_norm_eps: float = 1e-6


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class MambaMixer(RecurrentMixer):
    """Mamba (1) selective-SSM mixer over the flattened step (see the module doc)."""

    def __init__(self, config: MambaMixerConfig, hidden_size: int, prefix: str = "") -> None:
        super().__init__()
        self.config = c = config
        d = c.intermediate_size
        self.in_proj = ReplicatedLinear(hidden_size, 2 * d, c.proj_bias, _join(prefix, "in_proj"))
        self.conv1d = CausalConv1d(d, c.conv_kernel, c.conv_bias, activation_fn(c.activation))
        self.x_proj = ReplicatedLinear(d, c.time_step_rank + 2 * c.state_size, False, _join(prefix, "x_proj"))
        self.dt_proj = ReplicatedLinear(c.time_step_rank, d, True, _join(prefix, "dt_proj"))
        self.A_log = frozen_parameter(torch.empty(d, c.state_size), default_weight_loader)
        self.D = frozen_parameter(torch.empty(d), default_weight_loader)
        self.out_proj = ReplicatedLinear(d, hidden_size, c.proj_bias, _join(prefix, "out_proj"))
        if c.dt_bc_norm is not None:
            weighted = c.dt_bc_norm == "weighted"
            norm = lambda n: RMSNorm(n, c.dt_bc_norm_eps, has_weight=weighted)  # noqa: E731
            self.dt_layernorm, self.b_layernorm = norm(c.time_step_rank), norm(c.state_size)
            self.c_layernorm = norm(c.state_size)

    def state_shapes(self) -> tuple[StateShape, ...]:
        d = self.config.intermediate_size
        return StateShape(self.conv1d.window_shape), StateShape((d, self.config.state_size), torch.float32)

    def project_in(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.in_proj(hidden)  # [T, 2 * intermediate]: x | z

    def _ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., D] after the conv -> dt [..., D] (softplus'd), A [D, N], B, C [..., N]."""
        c = self.config
        dt, B, C = self.x_proj(x).split([c.time_step_rank, c.state_size, c.state_size], dim=-1)
        if c.dt_bc_norm is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = rowwise(F.softplus, self.dt_proj(dt).float())
        return dt, -torch.exp(self.A_log.float()), B, C

    def _output(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ((y + x.float() * self.D.float()) * rowwise(F.silu, z.float())).to(x.dtype)

    def mix_steps(self, xz: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        x, z = xz.chunk(2, dim=-1)
        x, window = self.conv1d.step(x, self.read_state(0, slots, has_state))
        self.write_state(0, slots, window)
        dt, A, B, C = self._ssm_inputs(x)
        y, state = selective_state_update(x, dt, A, B, C, self.read_state(1, slots, has_state))
        self.write_state(1, slots, state)
        return self._output(y, x, z)

    def mix_chunks(
        self, xz: torch.Tensor, lens: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor
    ) -> torch.Tensor:
        x, z = xz.chunk(2, dim=-1)
        x, window = self.conv1d.prefill(x, lens, self.read_state(0, slots, has_state))
        self.write_state(0, slots, window)
        dt, A, B, C = self._ssm_inputs(x)
        dt = dt * mask[..., None]  # padding neither decays nor updates the state
        y, state = selective_scan(x, dt, A, B, C, self.read_state(1, slots, has_state))
        self.write_state(1, slots, state)
        return self._output(y, x, z)

    def project_out(self, y: torch.Tensor) -> torch.Tensor:
        return self.out_proj(y)
