"""Dense linear methods for the CPU: the weight pre-packed into oneDNN's blocked layout (bf16, fp16; float32 in
batch-invariant mode), and row plans that keep a row's bits independent of the number of rows.

`F.linear` on a bf16 CPU tensor goes through oneDNN, which re-lays-out ("reorders") the weight into its
blocked format on every call. For decode-sized inputs that reorder costs as much as the matmul itself:
on SmolLM2's projections (2 AVX-512 cores) the 30 layers take ~28 ms at 1 token and ~32 ms at 32 tokens
with `F.linear`, ~12.5 and ~23 ms with the weight packed once after loading. Where oneDNN computes bf16 natively
the results are bitwise equal to `F.linear` (same kernel, same accumulation order); where it emulates bf16 (an
ISA cap below AVX512_CORE_BF16) its packed and plain kernels sum in different orders, so bf16 is not packed.

The packed copy sits next to the layer's dense weight, which stays the parameter that loaders, weight
updates and the tied embedding use; `ModelConfig.prepack_weights=false` turns packing off to save that
memory. A new weight (`weight_loader`) makes the layer dense again until `process_weights_after_loading`
packs it anew, so a packed copy is never stale.

In batch-invariant mode every dense weight, packed or not, is called by its row plan (layers/row_invariance.py),
probed per shape, dtype and kernel on this CPU.
"""

from __future__ import annotations

import abc
import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.core.cpuinfo import has_native_bf16
from llmplug.layers.kernels import amx_linear
from llmplug.layers.row_invariance import RowPlan, cached_row_plan, cancelling_weight, find_row_plan

__all__ = [
    "AmxLinearMethod", "PrepackedLinearMethod", "RowPlannedDenseMethod", "cpu_dense_method", "prepack_supported",
    "row_plan_for", "row_planned_methods", "row_variant_weights",
]

log = logging.getLogger(__name__)

# float32 is packed only in batch-invariant mode (LinearOptions.row_invariant): MKL's float32 matmul is as fast
_PACKABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# the probe of prepack_supported: a projection of SmolLM2's shape at row counts where oneDNN's emulated bf16 kernels
# (an ISA cap below AVX512_CORE_BF16) sum in another order than F.linear's
_PROBE_SHAPE, _PROBE_ROWS = (1536, 576), (1, 3, 9, 33)


@functools.lru_cache(maxsize=None)
def prepack_supported(device_type: str, dtype: torch.dtype) -> bool:
    """True when oneDNN's packed linear runs here for `dtype` and equals F.linear: bf16 only where oneDNN computes
    it natively (emulated, the packed and the plain kernels sum in different orders), probed on a real projection
    at several row counts (float32, where F.linear is MKL's and sums in another order: equal to rounding)."""
    if device_type != "cpu" or dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not has_native_bf16():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(_PROBE_SHAPE, generator=generator).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        same = True
        for rows in _PROBE_ROWS:
            x = torch.randn(rows, _PROBE_SHAPE[1], generator=generator).to(dtype)
            got, expected = _packed_linear(x, packed, None), F.linear(x, weight)
            same &= torch.equal(got, expected) if dtype != torch.float32 else torch.allclose(got, expected, atol=1e-4)
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        log.info("oneDNN packed linear unavailable for %s: %s", dtype, error)
        return False
    if not same:
        log.info("oneDNN packed linear differs from F.linear for %s; not used", dtype)
    return same


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# the kernels a row plan is probed for, each given the probe's weight: oneDNN's packed linear, and torch's F.linear
# (MKL or oneDNN inside, by dtype) for weights that cannot be packed here
_KERNELS: dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    "oneDNN packed": lambda weight: functools.partial(_call_packed, torch.ops.mkldnn._reorder_linear_weight(weight)),
    "torch F.linear": lambda weight: functools.partial(_call_dense, weight),
}


def _call_packed(packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _packed_linear(x, packed, None)


def _call_dense(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


@functools.lru_cache(maxsize=None)
def row_plan_for(kernel: str, out_features: int, in_features: int, dtype: torch.dtype, num_threads: int) -> RowPlan | None:
    """How `kernel` (a key of _KERNELS) must be called here so that an [out, in] weight gives each row the same bits
    for any number of rows (layers/row_invariance.py), or None where no plan holds. The kernel is chosen by shape,
    dtype, ISA and thread count, not by the data, so this is probed once per (shape, dtype, thread count) on
    inputs that show any change of summation order; `num_threads` is torch's current thread count."""
    def probe() -> RowPlan | None:
        matmul = _KERNELS[kernel](cancelling_weight(out_features, in_features).to(dtype))
        return find_row_plan(matmul, in_features, dtype)

    dtype_name = str(dtype).removeprefix("torch.")
    plan = cached_row_plan(f"{kernel.replace(' ', '-')}-{out_features}x{in_features}-{dtype_name}", probe)
    if plan is None:
        log.info("%s [%d x %d] %s sums rows in an order that depends on their number, and no row plan holds here",
                 kernel, out_features, in_features, dtype_name)
    return plan


class _RowPlannedLinear(abc.ABC):
    """A dense linear method that, in batch-invariant mode (`row_invariant`), gives a row the same bits for any
    number of rows. Where its kernel does not by itself (oneDNN's one-row kernel for long reductions on AVX-512,
    M-dependent blocking on AMX, MKL's float32 GEMM), the weight's `row_plan` (probed per shape when the layer
    is set up) pads or tiles the rows; `row_variant` marks a weight for which no plan holds (the engine then
    turns the mode off, or refuses it)."""

    kernel: str  # a key of _KERNELS

    def __init__(self, weight: torch.Tensor, row_invariant: bool) -> None:
        self.weight = weight.detach()  # the dense weight (a view of the parameter)
        threads = torch.get_num_threads()
        plan = row_plan_for(self.kernel, *weight.shape, weight.dtype, threads) if row_invariant else None
        self.row_variant = row_invariant and plan is None
        self.row_plan = None if plan == RowPlan() else plan  # None: one plain call for any number of rows

    @abc.abstractmethod
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T + b with the kernel, for any rows."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.row_plan is None or torch.compiler.is_compiling():
            return self.matmul(x, bias)
        rows = self.row_plan(lambda part: self.matmul(part, bias), x.reshape(-1, x.shape[-1]))
        return rows.view(*x.shape[:-1], -1)

    def describe(self) -> str:
        """The weight and its kernel, as the engine's messages name them: "[576 x 1536] bfloat16 (oneDNN packed)"."""
        out_features, in_features = self.weight.shape
        return f"[{out_features} x {in_features}] {str(self.weight.dtype).removeprefix('torch.')} ({self.kernel})"


class PrepackedLinearMethod(_RowPlannedLinear):
    """x W^T + b with W packed once into oneDNN's layout (row plans: see _RowPlannedLinear)."""

    kernel = "oneDNN packed"

    def __init__(self, weight: torch.Tensor, row_invariant: bool = False) -> None:
        super().__init__(weight, row_invariant)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the packed tensor is opaque to the compiler, the dense weight is not
            return F.linear(x, self.weight, bias)
        return _packed_linear(x, self.packed, bias)

    def __repr__(self) -> str:
        return "dense(packed)" if self.row_plan is None else f"dense(packed, {self.row_plan})"


class RowPlannedDenseMethod(_RowPlannedLinear):
    """F.linear with the layer's dense weight, in batch-invariant mode where the weight cannot be packed for oneDNN
    here (bf16 / fp16 without AVX-512, other devices' dtypes): MKL's and oneDNN's unpacked kernels also sum in
    orders that depend on the number of rows (on 2 AVX2 cores float32 needs tiles of 32 rows)."""

    kernel = "torch F.linear"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def __repr__(self) -> str:
        return "dense" if self.row_plan is None else f"dense({self.row_plan})"


class AmxLinearMethod(_RowPlannedLinear):
    """x W^T + b with llmplug's AMX kernel (layers/kernels/amx_linear.py), W packed once into its tiles: each row's
    sum in one fixed order, so batch invariant without a row plan (oneDNN's AMX kernels need tiles of 32 rows)."""

    kernel = "llmplug AMX"

    def __init__(self, weight: torch.Tensor) -> None:  # no probe: invariant by construction (its tests check)
        self.weight = weight.detach()
        self.row_variant, self.row_plan = False, None
        self.packed = amx_linear.pack_weight(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return amx_linear.amx_linear(x, self.packed, bias, self.weight.shape[0])

    def __repr__(self) -> str:
        return "dense(AMX)"


def cpu_dense_method(weight: torch.Tensor, pack: bool, row_invariant: bool) -> _RowPlannedLinear | None:
    """The method a dense 2-D weight computes with: in batch-invariant mode, bf16 packed for llmplug's AMX kernel
    where AMX runs; packed for oneDNN where `pack` asks for it and oneDNN packs its dtype here; else, in
    batch-invariant mode on the CPU, F.linear by its row plan; None: plain F.linear."""
    if pack and row_invariant and amx_linear.packable(weight) and amx_linear.amx_linear_enabled():
        return AmxLinearMethod(weight)
    if pack and prepack_supported(weight.device.type, weight.dtype):
        return PrepackedLinearMethod(weight, row_invariant)
    if row_invariant and weight.device.type == "cpu":
        return RowPlannedDenseMethod(weight, row_invariant=True)
    return None


def row_planned_methods(model: nn.Module) -> list[_RowPlannedLinear]:
    """Every dense weight of `model` with a row plan: layers' `quant_method`s and the lists MoE experts and routers
    keep."""
    found = []
    for module in model.modules():
        for value in vars(module).values():
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                parts = item if isinstance(item, tuple) else (item,)
                found.extend(part for part in parts if isinstance(part, _RowPlannedLinear))
    return found


def row_variant_weights(model: nn.Module) -> list[str]:
    """`model`'s weights (shape, dtype, kernel) for which batch-invariant mode found no row plan on this CPU, and
    the layers of a quantized checkpoint whose method declares its rows depend on their number."""
    from llmplug.quantization.base import QuantizedExpertsMethod, QuantizedLinearMethod

    variant = {method.describe() for method in row_planned_methods(model) if method.row_variant}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, (QuantizedLinearMethod, QuantizedExpertsMethod)) and not method.row_invariant:
            name = getattr(module, "prefix", "") or type(module).__name__
            variant.add(f"{name} ({type(method).__name__}, whose rows depend on their number)")
    return sorted(variant)
