"""The gated delta net mixer (Qwen3-Next, Qwen3.5): linear attention with the gated delta rule.

Projections -> q, k, v (one causal conv over [q | k | v], then silu), z, b, a; q and k are
L2-normalized per head; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) (log decay);
o = gated_delta_rule(q, k, v, g, beta) with scale key_head_dim^-0.5; out_proj(gated_norm(o, z)),
the norm per value head and before the gate. Key heads are shared by num_value_heads / num_key_heads
value heads. Per-request state: the conv window [conv_dim, kernel - 1] and the delta-rule state
[value_heads, key_head_dim, value_head_dim] (float32).

Checkpoint layouts (`projection_layout`): "grouped" (Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`,
their rows interleaved per key head), "split" (Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`), "fused" (Lara Mini: one `in_proj`, rows [q | k | v | z | b | a]) or "separate" (OLMo
hybrid: `in_proj_q`, `_k`, `_v`, `_z`, `_b`, `_a`, and a conv per q, k, v: `q_conv1d`, ... load as parts of
`conv1d`; its `beta_scale` of 2). Every rank holds the whole mixer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from llmplug.layers.activation import activation_fn
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.recurrent.causal_conv import CausalConv1d
from llmplug.layers.recurrent.gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_step, l2_normalize
from llmplug.layers.recurrent.gated_norm import GatedRMSNorm
from llmplug.layers.recurrent.state import RecurrentMixer, StateShape
from llmplug.layers.rowwise import rowwise
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["GatedDeltaNet", "GatedDeltaNetConfig", "ProjectionLayout"]

ProjectionLayout = Literal["grouped", "split", "fused", "separate"]  # how a checkpoint stores the projections


@dataclass(frozen=True, slots=True)
class GatedDeltaNetConfig:
    """Sizes and checkpoint layout of a gated delta net mixer."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    norm_eps: float = 1e-6
    activation: str = "silu"  # after the conv
    projection_layout: ProjectionLayout = "split"
    beta_scale: float = 1.0  # beta = scale * sigmoid(b): 2.0 allows negative eigenvalues (OLMo hybrid)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class GatedDeltaNet(RecurrentMixer):
    """Gated delta net mixer over the flattened step (see the module doc)."""

    def __init__(self, config: GatedDeltaNetConfig, hidden_size: int, prefix: str = "") -> None:
        super().__init__()
        self.config = c = config
        linear = lambda name, n: ReplicatedLinear(hidden_size, n, False, _join(prefix, name))  # noqa: E731
        if c.projection_layout == "grouped":
            self.in_proj_qkvz = linear("in_proj_qkvz", c.conv_dim + c.value_dim)
            self.in_proj_ba = linear("in_proj_ba", 2 * c.num_value_heads)
        elif c.projection_layout == "fused":
            self.in_proj = linear("in_proj", c.conv_dim + c.value_dim + 2 * c.num_value_heads)
        elif c.projection_layout == "separate":
            self.in_proj_q, self.in_proj_k = linear("in_proj_q", c.key_dim), linear("in_proj_k", c.key_dim)
            self.in_proj_v, self.in_proj_z = linear("in_proj_v", c.value_dim), linear("in_proj_z", c.value_dim)
            self.in_proj_b = linear("in_proj_b", c.num_value_heads)
            self.in_proj_a = linear("in_proj_a", c.num_value_heads)
        else:
            self.in_proj_qkv = linear("in_proj_qkv", c.conv_dim)
            self.in_proj_z = linear("in_proj_z", c.value_dim)
            self.in_proj_b = linear("in_proj_b", c.num_value_heads)
            self.in_proj_a = linear("in_proj_a", c.num_value_heads)
        parts = (c.key_dim, c.key_dim, c.value_dim) if c.projection_layout == "separate" else ()  # q, k, v convs
        self.conv1d = CausalConv1d(c.conv_dim, c.conv_kernel, False, activation_fn(c.activation), parts)
        self.dt_bias = frozen_parameter(torch.empty(c.num_value_heads), default_weight_loader)
        self.A_log = frozen_parameter(torch.empty(c.num_value_heads), default_weight_loader)
        self.norm = GatedRMSNorm(c.value_head_dim, c.value_head_dim, c.norm_eps, norm_before_gate=True)
        self.out_proj = ReplicatedLinear(c.value_dim, hidden_size, False, _join(prefix, "out_proj"))

    def state_shapes(self) -> tuple[StateShape, ...]:
        c = self.config
        state = (c.num_value_heads, c.key_head_dim, c.value_head_dim)
        return StateShape(self.conv1d.window_shape), StateShape(state, torch.float32)

    def project_in(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, q | k | v | z | b | a], heads in order whatever the checkpoint layout."""
        if self.config.projection_layout == "fused":
            return self.in_proj(hidden)
        if self.config.projection_layout == "split":
            parts = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
            return torch.cat([proj(hidden) for proj in parts], dim=-1)
        if self.config.projection_layout == "separate":
            parts = (self.in_proj_q, self.in_proj_k, self.in_proj_v, self.in_proj_z, self.in_proj_b, self.in_proj_a)
            return torch.cat([proj(hidden) for proj in parts], dim=-1)
        c = self.config
        per_key_head = c.num_value_heads // c.num_key_heads
        qkvz = self.in_proj_qkvz(hidden).unflatten(-1, (c.num_key_heads, -1))  # [T, Hk, 2 dk + 2 r dv]
        v_width = per_key_head * c.value_head_dim
        q, k, v, z = qkvz.split([c.key_head_dim, c.key_head_dim, v_width, v_width], dim=-1)
        b, a = self.in_proj_ba(hidden).unflatten(-1, (c.num_key_heads, -1)).split(per_key_head, dim=-1)
        return torch.cat([t.flatten(-2) for t in (q, k, v, z, b, a)], dim=-1)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        return x.split([c.conv_dim, c.value_dim, c.num_value_heads, c.num_value_heads], dim=-1)

    def _rule_inputs(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """After the conv: q, k [..., Hk, Dk] (L2-normalized), v [..., Hv, Dv], g, beta [..., Hv]."""
        c = self.config
        q, k, v = qkv.split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        q, k = (l2_normalize(t.float().unflatten(-1, (c.num_key_heads, c.key_head_dim))) for t in (q, k))
        g = -self.A_log.float().exp() * rowwise(F.softplus, a.float() + self.dt_bias.float())
        beta = rowwise(torch.sigmoid, b.float())
        beta = beta * c.beta_scale if c.beta_scale != 1.0 else beta
        return q, k, v.unflatten(-1, (c.num_value_heads, c.value_head_dim)), g, beta

    def _output(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o [..., Hv, Dv], z [..., Hv * Dv] -> [..., Hv * Dv]."""
        return self.norm(o.to(dtype), z.unflatten(-1, o.shape[-2:])).flatten(-2)

    def mix_steps(self, x: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        qkv, z, b, a = self._split(x)
        qkv, window = self.conv1d.step(qkv, self.read_state(0, slots, has_state))
        self.write_state(0, slots, window)
        q, k, v, g, beta = self._rule_inputs(qkv, b, a)
        scale = self.config.key_head_dim**-0.5
        o, state = gated_delta_rule_step(q, k, v, g, beta, self.read_state(1, slots, has_state), scale)
        self.write_state(1, slots, state)
        return self._output(o, z, x.dtype)

    def mix_chunks(
        self, x: torch.Tensor, lens: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor
    ) -> torch.Tensor:
        qkv, z, b, a = self._split(x)
        qkv, window = self.conv1d.prefill(qkv, lens, self.read_state(0, slots, has_state))
        self.write_state(0, slots, window)
        q, k, v, g, beta = self._rule_inputs(qkv, b, a)
        keep = mask[..., None]
        g, beta = g * keep, beta * keep  # padding neither decays nor updates the state
        scale = self.config.key_head_dim**-0.5
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, self.read_state(1, slots, has_state), scale)
        self.write_state(1, slots, state)
        return self._output(o, z, x.dtype)

    def project_out(self, y: torch.Tensor) -> torch.Tensor:
        return self.out_proj(y)
