"""Depthwise causal 1-D convolution with a carried window: the short convolution of Mamba, Mamba 2,
gated delta nets and LFM2.

A request's conv state is the window of the last `kernel - 1` inputs before its next token, so a
chunked prompt or a decode step convolves exactly as one pass over the whole sequence would.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["CausalConv1d", "causal_conv1d_prefill", "causal_conv1d_step"]

Activation = Callable[[torch.Tensor], torch.Tensor] | None


def causal_conv1d_prefill(
    x: torch.Tensor,
    lens: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Activation = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convolve padded chunks that continue from their windows.

    x [B, L, C] (positions at or past `lens` [B] are padding), window [B, C, K - 1] (zeros for a first
    chunk), weight [C, K] -> (out [B, L, C], the new windows [B, C, K - 1]).
    """
    num_reqs, _, channels = x.shape
    width = weight.shape[1] - 1
    full = torch.cat([window.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, C, K - 1 + L]
    out = F.conv1d(full, weight.unsqueeze(1), bias, groups=channels)  # [B, C, L]
    # the last K - 1 real inputs of each request: columns lens .. lens + K - 2 of `full`
    last = lens.view(-1, 1) + torch.arange(width, device=x.device)  # [B, K - 1]
    new_window = full.gather(2, last.view(num_reqs, 1, width).expand(num_reqs, channels, width))
    out = out.transpose(1, 2)
    return (out if activation is None else activation(out)), new_window


def causal_conv1d_step(
    x: torch.Tensor,
    window: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: Activation = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per request: x [B, C], window [B, C, K - 1] -> (out [B, C], new window [B, C, K - 1])."""
    full = torch.cat([window.to(x.dtype), x.unsqueeze(2)], dim=2)  # [B, C, K]
    out = torch.einsum("bck,ck->bc", full, weight)
    if bias is not None:
        out = out + bias
    return (out if activation is None else activation(out)), full[:, :, 1:]


class CausalConv1d(nn.Module):
    """The weights of a depthwise causal conv, as torch.nn.Conv1d stores them (weight [C, 1, K], bias [C]),
    and the two ways to run it on a request's window.

    `parts`: the channel counts of convs a checkpoint stores separately (OLMo hybrid's q, k and v convs);
    the weight then loads part by part (shard id: the part's index) into consecutive channels.
    """

    def __init__(
        self, channels: int, kernel: int, bias: bool, activation: Activation = None, parts: tuple[int, ...] = ()
    ) -> None:
        super().__init__()
        self.channels, self.kernel, self.activation = channels, kernel, activation
        if parts and sum(parts) != channels:
            raise ValueError(f"conv parts {parts} do not add up to its {channels} channels")
        self.parts = parts
        self.weight = frozen_parameter(torch.empty(channels, 1, kernel), self._load_weight)
        self.bias = frozen_parameter(torch.empty(channels), default_weight_loader) if bias else None

    def _load_weight(self, param: torch.nn.Parameter, loaded: torch.Tensor, part: int | None = None) -> None:
        if part is None:
            return default_weight_loader(param, loaded)
        start = sum(self.parts[:part])
        default_weight_loader(param[start : start + self.parts[part]], loaded)

    @property
    def window_shape(self) -> tuple[int, int]:
        """The per-request state: the last kernel - 1 inputs of each channel."""
        return self.channels, self.kernel - 1

    def prefill(self, x: torch.Tensor, lens: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See causal_conv1d_prefill."""
        return causal_conv1d_prefill(x, lens, window, self.weight[:, 0], self.bias, self.activation)

    def step(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See causal_conv1d_step."""
        return causal_conv1d_step(x, window, self.weight[:, 0], self.bias, self.activation)

    def extra_repr(self) -> str:
        return f"{self.channels}, kernel={self.kernel}, bias={self.bias is not None}"
