"""Dense linear layers with their weight pre-packed into oneDNN's blocked layout (CPU, bf16 and fp16).

`F.linear` on a bf16 CPU tensor goes through oneDNN, which re-lays-out ("reorders") the weight into its
blocked format on every call. For decode-sized inputs that reorder costs as much as the matmul itself:
on SmolLM2's projections (2 AVX-512 cores) the 30 layers take ~28 ms at 1 token and ~32 ms at 32 tokens
with `F.linear`, ~12.5 and ~23 ms with the weight packed once after loading. The results are bitwise
equal to `F.linear` (same kernel, same accumulation order), row by row whatever the batch.

The packed copy sits next to the layer's dense weight, which stays the parameter that loaders, weight
updates and the tied embedding use; `ModelConfig.prepack_weights=false` turns packing off to save that
memory. A new weight (`weight_loader`) makes the layer dense again until `process_weights_after_loading`
packs it anew, so a packed copy is never stale.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PrepackedLinearMethod", "prepack_supported"]

log = logging.getLogger(__name__)

# float32 is packed only in batch-invariant mode (LinearOptions.row_invariant): MKL's float32 matmul is as fast
_PACKABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def prepack_supported(device_type: str, dtype: torch.dtype) -> bool:
    """True when oneDNN's packed linear runs here for `dtype` and equals F.linear (probed on a tiny weight;
    float32, where F.linear is MKL's and sums in another order: equal to rounding)."""
    if device_type != "cpu" or dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.randn(16, 32).to(dtype)
        x = torch.randn(3, 32).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        got, expected = _packed_linear(x, packed, None), F.linear(x, weight)
        same = torch.equal(got, expected) if dtype != torch.float32 else torch.allclose(got, expected, atol=1e-5)
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        log.info("oneDNN packed linear unavailable for %s: %s", dtype, error)
        return False
    if not same:
        log.info("oneDNN packed linear differs from F.linear for %s; not used", dtype)
    return same


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@functools.lru_cache(maxsize=None)
def lone_row_differs(out_features: int, in_features: int, dtype: torch.dtype, num_threads: int) -> bool:
    """Whether oneDNN computes a lone row of an [out, in] weight in another summation order than the same row
    among 8 (the kernel is chosen by shape, dtype and thread count, not by the data; `num_threads`, torch's
    current thread count, is part of the cache key).

    Probed on rows built to show any order difference: each holds +2^20 and -2^20 at two columns whose weights
    are equal, so the products cancel exactly, but the small terms summed between them lose low bits to the
    large running sum, and how many depends on the order. Equal orders give equal bits.
    """
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(8, in_features, generator=generator)
    for row in range(8):
        first, last = row % 4, in_features - 1 - row % 4
        weight[:, last] = weight[:, first]
        x[row, first], x[row, last] = 2.0**20, -(2.0**20)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype))
    x = x.to(dtype)
    batched = _packed_linear(x, packed, None)
    return any(not torch.equal(_packed_linear(x[i : i + 1], packed, None), batched[i : i + 1]) for i in range(8))


class PrepackedLinearMethod:
    """x W^T + b with W packed once into oneDNN's layout.

    row_invariant (batch-invariant mode): a lone row gets the result it gets among other rows. oneDNN gives a
    row the same result for any number of rows >= 2, but for one row and a long reduction (SmolLM2's
    1536 -> 576 down projection) it takes a matrix-vector kernel that sums in another order; such weights
    (found by a probe at packing time) compute a lone row as two.
    """

    def __init__(self, weight: torch.Tensor, row_invariant: bool = False) -> None:
        self.weight = weight.detach()  # the dense weight (a view of the parameter), for the compiler
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        out_features, in_features = weight.shape
        # batch-invariant mode, where oneDNN's one-row kernel sums otherwise: compute a lone row as two
        self.lone_row_as_two = row_invariant and lone_row_differs(
            out_features, in_features, weight.dtype, torch.get_num_threads()
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the packed tensor is opaque to the compiler, the dense weight is not
            return F.linear(x, self.weight, bias)
        if self.lone_row_as_two and x.numel() == x.shape[-1]:  # one row
            two = x.reshape(1, -1).repeat(2, 1)
            return _packed_linear(two, self.packed, bias)[:1].view(*x.shape[:-1], -1)
        return _packed_linear(x, self.packed, bias)

    def __repr__(self) -> str:
        return "dense(packed)"
