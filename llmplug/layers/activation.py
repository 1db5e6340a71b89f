"""MLP activations by their transformers names, plain and gated (act(gate) * up).

`ACTIVATIONS` maps each supported `hidden_act` name to a function with transformers' semantics;
`gelu_new`, `gelu_fast` and `gelu_pytorch_tanh` are all the tanh approximation, computed by torch's
one fused kernel. xIELU (Apertus) has learned parameters, so it is a module of its own (`XIELU`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.kernels import use_triton
from llmplug.layers.kernels.native import ops, use_native
from llmplug.layers.rowwise import rowwise
from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "ActivationAndMul",
    "ClampedSwiGLU",
    "SiluAndMul",
    "XIELU",
    "activation_fn",
    "gated_activation",
]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# transformers' ACT2FN name -> the function
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "relu2": _relu2,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation transformers calls `name`; ValueError listing the supported ones otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class Activation(nn.Module):
    """act(x) for a non-gated MLP."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.fn = name, activation_fn(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., d]; each row the same whatever the number of rows (layers/rowwise.py)."""
        return rowwise(self.fn, x)

    def extra_repr(self) -> str:
        return self.name


class ActivationAndMul(Activation):
    """act(gate) * up for x = [gate | up]: [..., 2 * d] -> [..., d] (GLU variants: SwiGLU, GeGLU, ...)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] -> [..., d]."""
        d = x.shape[-1] // 2
        return rowwise(self.fn, x[..., :d]).mul_(x[..., d:])


class SiluAndMul(ActivationAndMul):
    """silu(gate) * up for x = [gate | up]: [..., 2 * d] -> [..., d] (SwiGLU)."""

    def __init__(self) -> None:
        super().__init__("silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] -> [..., d]; one kernel: Triton on a GPU (`use_triton`), llmplug's own on the CPU
        (`use_native`)."""
        d = x.shape[-1] // 2
        if use_triton(x):
            from llmplug.layers.kernels.activation import silu_and_mul

            return silu_and_mul(x.reshape(-1, 2 * d)).view(*x.shape[:-1], d)
        if use_native(x) and x.stride(-1) == 1:
            return ops().silu_and_mul(x.reshape(-1, 2 * d)).view(*x.shape[:-1], d)
        return super().forward(x)


def gated_activation(name: str) -> ActivationAndMul:
    """act(gate) * up for transformers' `name`: SiluAndMul (with its GPU kernel) for silu, else ActivationAndMul."""
    return SiluAndMul() if ACTIVATIONS.get(name) is F.silu else ActivationAndMul(name)


class ClampedSwiGLU(nn.Module):
    """GPT-OSS's gated activation of x = [gate | up]: gate clamped above at `limit`, up to [-limit, limit],
    gate * sigmoid(alpha * gate) * (up + 1)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2 * d] -> [..., d]."""
        d = x.shape[-1] // 2
        gate, up = x[..., :d].clamp(max=self.limit), x[..., d:].clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


def _scalar_parameter(value: float) -> nn.Parameter:
    return frozen_parameter(torch.tensor([value]), default_weight_loader)


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010): learned quadratic for x > 0, learned ELU-like branch for x <= 0.

    Parameters as transformers stores them: `alpha_p`, `alpha_n` (before softplus), `beta`, `eps`.
    """

    def __init__(self, alpha_p: float = 0.8, alpha_n: float = 0.8, beta: float = 0.5, eps: float = -1e-6) -> None:
        super().__init__()
        self.alpha_p = _scalar_parameter(math.log(math.expm1(alpha_p)))
        self.alpha_n = _scalar_parameter(math.log(math.expm1(alpha_n - beta)))
        self.beta = frozen_parameter(torch.tensor(beta), default_weight_loader)
        self.eps = frozen_parameter(torch.tensor(eps), default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., d]."""
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        positive = alpha_p * x * x + self.beta * x
        negative = (torch.expm1(torch.clamp_max(x, self.eps)) - x) * alpha_n + self.beta * x
        return torch.where(x > 0, positive, negative)
