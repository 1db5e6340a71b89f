"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm decoder."""

from __future__ import annotations

import torch
from torch import nn

from llmplug.layers.weight_utils import default_weight_loader, frozen_parameter

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension, as transformers' LlamaRMSNorm.

    The statistic and the normalization are computed in float32 and rounded once to x's dtype, then
    multiplied by the weight in that dtype (the rounding transformers applies). In a reduced-precision
    model no float32 copy of x is made: the sum of squares accumulates in float32 straight from x,
    and x times the float32 scale is stored directly in x's dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size, self.variance_epsilon = hidden_size, eps
        self.weight = frozen_parameter(torch.ones(hidden_size), default_weight_loader)
        # eps as a float32 tensor for the fused add below; not a buffer, so model.to(dtype) keeps it float32
        self._eps = torch.tensor(eps, dtype=torch.float32)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum written into x in place.

        The in-place add is safe in a decoder because x is the fresh output of the sublayer before.
        """
        if residual is None:
            return self._normalize(x)
        residual = x.add_(residual)
        return self._normalize(residual), residual

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> normalized and weighted, in x's dtype (x is not modified)."""
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # [..., 1] sqrt(sum x^2)
        eps = self._eps if self._eps.device == x.device else self._eps_on(x.device)
        inv_rms = torch.addcmul(eps, norm, norm, value=1.0 / self.hidden_size).rsqrt_()  # 1 / sqrt(mean + eps)
        out = torch.mul(x, inv_rms, out=torch.empty_like(x))  # float32 product, rounded to x's dtype
        return out.mul_(self.weight)

    def _eps_on(self, device: torch.device) -> torch.Tensor:
        """The eps tensor on the activations' device, made once (the module may have been built on meta)."""
        self._eps = torch.tensor(self.variance_epsilon, dtype=torch.float32, device=device)
        return self._eps

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
