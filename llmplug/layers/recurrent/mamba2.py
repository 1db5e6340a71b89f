"""Mamba 2's mixer (Mamba2, Bamba, NemotronH, Falcon-H1, Zamba 2, GraniteMoeHybrid): SSD over grouped heads.

in_proj -> (z, xBC, dt); xBC -> causal conv -> act -> (x, B, C); dt = softplus(dt + dt_bias), clamped
to time_step_limit; y = ssd(x, dt, A = -exp(A_log), B, C) + D x; out_proj(gated_norm(y, z)).
Per-request state: the conv window [conv_dim, kernel - 1] and the SSM state [heads, head_dim, state]
(float32). Parameter names are transformers' (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`,
`out_proj`). Every rank holds the whole mixer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmplug.layers.activation import activation_fn
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.recurrent.causal_conv import CausalConv1d
from llmplug.layers.recurrent.gated_norm import GatedRMSNorm
from llmplug.layers.recurrent.ssd import ssd_scan, ssd_state_update
from llmplug.layers.recurrent.state import RecurrentMixer, StateShape
from llmplug.layers.rowwise import rowwise
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["Mamba2Mixer", "Mamba2MixerConfig"]


@dataclass(frozen=True, slots=True)
class Mamba2MixerConfig:
    """Sizes and variants of a Mamba 2 mixer."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int = 256  # tokens per SSD chunk (numerics only: any size gives the same result)
    conv_bias: bool = True
    proj_bias: bool = False  # on in_proj and out_proj
    activation: str = "silu"  # after the conv
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float = 1e-5
    gated_norm: bool = True  # False (Falcon-H1's mamba_rms_norm=False): y * silu(z), no norm
    norm_before_gate: bool = False
    # Falcon-H1's muP: the input scaled, and each part of in_proj's output (z, x, B, C, dt) by its own factor
    in_multiplier: float = 1.0
    projection_multipliers: tuple[float, float, float, float, float] | None = None

    @property
    def intermediate_size(self) -> int:
        """Features of x, z and y: heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class Mamba2Mixer(RecurrentMixer):
    """Mamba 2 mixer over the flattened step (see the module doc)."""

    def __init__(self, config: Mamba2MixerConfig, hidden_size: int, prefix: str = "") -> None:
        super().__init__()
        self.config = c = config
        d, h = c.intermediate_size, c.num_heads
        self.in_proj = ReplicatedLinear(hidden_size, d + c.conv_dim + h, c.proj_bias, _join(prefix, "in_proj"))
        self.conv1d = CausalConv1d(c.conv_dim, c.conv_kernel, c.conv_bias, activation_fn(c.activation))
        self.dt_bias = frozen_parameter(torch.empty(h), default_weight_loader)
        self.A_log = frozen_parameter(torch.empty(h), default_weight_loader)
        self.D = frozen_parameter(torch.empty(h), default_weight_loader)
        if c.gated_norm:
            self.norm = GatedRMSNorm(d, d // c.n_groups, c.norm_eps, c.norm_before_gate)
        self.out_proj = ReplicatedLinear(d, hidden_size, c.proj_bias, _join(prefix, "out_proj"))
        if c.projection_multipliers is not None:
            sizes = (d, d, c.n_groups * c.state_size, c.n_groups * c.state_size, h)
            scale = torch.cat([torch.full((n,), m) for n, m in zip(sizes, c.projection_multipliers)])
            self.register_buffer("projection_scale", scale, persistent=False)

    def state_shapes(self) -> tuple[StateShape, ...]:
        c = self.config
        return StateShape(self.conv1d.window_shape), StateShape((c.num_heads, c.head_dim, c.state_size), torch.float32)

    def project_in(self, hidden: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.in_multiplier != 1.0:
            hidden = hidden * c.in_multiplier
        projected = self.in_proj(hidden)  # [T, z | xBC | dt]
        return projected if c.projection_multipliers is None else projected * self.projection_scale.to(projected.dtype)

    def _split(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        return projected.split([c.intermediate_size, c.conv_dim, c.num_heads], dim=-1)

    def _ssm_inputs(self, xBC: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """After the conv: x [..., H, P], dt [..., H] (softplus'd, clamped), A [H], B, C [..., G, N]."""
        c = self.config
        gn = c.n_groups * c.state_size
        x, B, C = xBC.split([c.intermediate_size, gn, gn], dim=-1)
        dt = rowwise(F.softplus, dt.float() + self.dt_bias.float()).clamp(*c.time_step_limit)
        groups = (c.n_groups, c.state_size)
        return x.unflatten(-1, (c.num_heads, c.head_dim)), dt, -torch.exp(self.A_log.float()), (
            B.unflatten(-1, groups)), C.unflatten(-1, groups)

    def _output(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, x [..., H, P], z [..., H * P] -> the gated (and normed) output [..., H * P]."""
        y = (y + x.float() * self.D.float()[:, None]).flatten(-2).to(x.dtype)
        return self.norm(y, z) if self.config.gated_norm else (y.float() * rowwise(F.silu, z.float())).to(x.dtype)

    def mix_steps(self, projected: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        z, xBC, dt = self._split(projected)
        xBC, window = self.conv1d.step(xBC, self.read_state(0, slots, has_state))
        self.write_state(0, slots, window)
        x, dt, A, B, C = self._ssm_inputs(xBC, dt)
        y, state = ssd_state_update(x, dt, A, B, C, self.read_state(1, slots, has_state))
        self.write_state(1, slots, state)
        return self._output(y, x, z)

    def mix_chunks(
        self, projected: torch.Tensor, lens: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor,
        has_state: torch.Tensor,
    ) -> torch.Tensor:
        z, xBC, dt = self._split(projected)
        xBC, window = self.conv1d.prefill(xBC, lens, self.read_state(0, slots, has_state))
        self.write_state(0, slots, window)
        x, dt, A, B, C = self._ssm_inputs(xBC, dt)
        dt = dt * mask[..., None]  # padding neither decays nor updates the state
        y, state = ssd_scan(x, dt, A, B, C, self.read_state(1, slots, has_state), self.config.chunk_size)
        self.write_state(1, slots, state)
        return self._output(y, x, z)

    def project_out(self, y: torch.Tensor) -> torch.Tensor:
        return self.out_proj(y)
