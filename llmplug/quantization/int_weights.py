"""Integer group-quantized weights (GPTQ, AWQ, compressed-tensors pack-quantized): the shared part of their methods.

Each format unpacks its checkpoint tensors into `IntWeights`, w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] with
g = g_idx[k] (k // group_size without g_idx), and `IntWeightsMethod` does the rest once, after loading:

- act-order (g_idx): the input columns are permuted so each group's columns are contiguous (x's columns get the
  same permutation in `apply`);
- the int4 kernel's form (`Int4Groups`, layers/quantization.py): 4-bit q is one plane, (q - 8) * s + (8 - z) * s;
  8-bit q is two planes, its high nibble with scale 16 s and its low nibble with scale s (the zero goes with the
  high plane); a group size the kernel lacks (per-channel, 512, ...) repeats its scale over kernel groups of the
  largest size dividing it, which is exact;
- the checkpoint's tensors are freed; the packed weight stays ~4 bits a weight per plane.

Where the kernel cannot serve (not available for the device and dtype, a shape it cannot pack, act-order groups of
unequal sizes, or in batch-invariant mode a shape whose rows the kernel does not keep invariant), the layer
computes with a dense dequantized weight instead, after one warning naming the layer: the one dense copy a
quantized checkpoint ever gets.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.core.errors import ModelLoadError
from llmplug.layers.packed_linear import cpu_dense_method
from llmplug.layers.quantization import (
    Int4Groups,
    Int4LinearMethod,
    LinearMethod,
    LinearOptions,
    PackedInt4,
    int4_kernel_supported,
    int4_rows_invariant,
    packable,
)
from llmplug.quantization.base import QuantizedLinearMethod

if TYPE_CHECKING:
    from llmplug.layers.linear import LinearBase

__all__ = [
    "IntWeights", "IntWeightsMethod", "dense_fallback", "float_loader", "free_checkpoint_tensors", "pack_int4",
    "unpack_int32",
]

log = logging.getLogger(__name__)

_KERNEL_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu takes, largest first


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Sequence[int] | None = None) -> torch.Tensor:
    """Unpack int32 words of 32 / bits values each along `dim` (lowest bits first) into int32 values 0..2^bits-1.

    `order`: the position inside each word's run of values that the value in its i-th bit field belongs to (AWQ
    interleaves nibbles); None: the i-th field is the i-th value.
    """
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.movedim(dim, -1)
    values = (words.unsqueeze(-1) >> shifts) & (2**bits - 1)  # [..., L, per_word], field i of each word
    if order is not None:
        values = values[..., torch.tensor(order).argsort()]  # field order[i] holds value i
    return values.reshape(*words.shape[:-1], words.shape[-1] * per_word).movedim(-1, dim)


@dataclass(frozen=True, slots=True)
class IntWeights:
    """w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], g = g_idx[k] (None: k // (K / G), contiguous groups)."""

    q: torch.Tensor  # [N, K] int32, 0..2^bits-1
    scale: torch.Tensor  # [N, G] float32
    zero: torch.Tensor  # [N, G] float32 (integer-valued for these formats)
    bits: int
    g_idx: torch.Tensor | None = None  # [K] int64

    def group_of_columns(self) -> torch.Tensor:
        """[K] the group of each input column."""
        k, g = self.q.shape[1], self.scale.shape[1]
        return self.g_idx if self.g_idx is not None else torch.arange(k, device=self.q.device) // (k // g)

    def dequantize(self) -> torch.Tensor:
        """The dense weight, [N, K] float32."""
        groups = self.group_of_columns()
        return (self.q.float() - self.zero[:, groups]) * self.scale[:, groups]

    def contiguous(self) -> tuple[IntWeights, torch.Tensor | None] | None:
        """The same weight with contiguous groups of equal size and the column permutation that gives it (None:
        none needed); None when act-order groups are of unequal sizes."""
        if self.g_idx is None:
            return self, None
        perm = torch.argsort(self.g_idx, stable=True)
        used, counts = torch.unique_consecutive(self.g_idx[perm], return_counts=True)
        if bool((counts != counts[0]).any()):
            return None
        regrouped = IntWeights(self.q[:, perm], self.scale[:, used], self.zero[:, used], self.bits)
        identity = torch.equal(perm, torch.arange(perm.numel(), device=perm.device))
        return regrouped, None if identity else perm

    def int4_groups(self) -> Int4Groups | None:
        """The kernel's planes (contiguous groups only); None when no kernel group size divides the group size."""
        k, g = self.q.shape[1], self.scale.shape[1]
        size = k // g
        kernel_size = next((s for s in _KERNEL_GROUP_SIZES if size % s == 0), None)
        if kernel_size is None or self.bits not in (4, 8):
            return None
        scale = self.scale.repeat_interleave(size // kernel_size, dim=1)
        zero = self.zero.repeat_interleave(size // kernel_size, dim=1)
        if self.bits == 4:  # (q - z) s = (q - 8) s + (8 - z) s
            planes = [(self.q, scale, (8 - zero) * scale)]
        else:  # q = 16 hi + lo: (hi - 8) 16 s + (lo - 8) s + (136 - z) s
            planes = [(self.q >> 4, 16 * scale, (136 - zero) * scale), (self.q & 15, scale, torch.zeros_like(scale))]
        q, scales, zeros = (torch.stack(parts) for parts in zip(*planes))
        return Int4Groups(q.to(torch.uint8), scales, zeros, kernel_size)


def float_loader(param: nn.Parameter) -> nn.Parameter:
    """Let `param` (float32) load a checkpoint tensor of any float dtype, converted exactly (fp16/bf16 -> fp32);
    other dtypes still go to its own loader, which names them. Returns `param`."""
    load = param.weight_loader  # type: ignore[attr-defined]

    def convert(target: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        load(target, loaded.float() if loaded.is_floating_point() else loaded, *shard)

    param.weight_loader = convert  # type: ignore[attr-defined]
    return param


def free_checkpoint_tensors(layer: nn.Module, names: tuple[str, ...]) -> None:
    """Drop the layer's checkpoint-form parameters `names`; a quantized layer's `weight` stays None."""
    for name in names:
        if hasattr(layer, name):
            delattr(layer, name)
    layer.register_parameter("weight", None)


def pack_int4(
    weights: IntWeights, dtype: torch.dtype, options: LinearOptions
) -> tuple[str, tuple[PackedInt4, torch.Tensor | None] | None]:
    """The int4 kernel's form of `weights` for activations of `dtype`: (why not, None) or ("", (the packed weight,
    the column permutation))."""
    device = weights.q.device
    if not int4_kernel_supported(device.type, dtype):
        return f"torch's int4 kernel is not available on {device.type} for {dtype}", None
    regrouped = weights.contiguous()
    if regrouped is None:
        return "its act-order groups are of unequal sizes", None
    groups = regrouped[0].int4_groups()
    if groups is None:
        return f"its group size {weights.q.shape[1] // weights.scale.shape[1]} is no multiple of 32", None
    reason = packable(groups)
    if reason is not None:
        return reason, None
    n, k = weights.q.shape
    threads = torch.get_num_threads()
    if options.row_invariant and not int4_rows_invariant(n, k, groups.num_planes, dtype, threads):
        return "the int4 kernel's rows depend on their number for this shape (batch-invariant mode)", None
    return "", (PackedInt4.pack(groups, dtype, device), regrouped[1])


def dense_fallback(weights: IntWeights, dtype: torch.dtype, options: LinearOptions) -> tuple[LinearMethod, bool]:
    """Where the int4 kernel cannot serve: (a dense method on the dequantized weight in `dtype`, whether its rows
    are invariant: where batch-invariant mode found the dense kernel a row plan)."""
    dense = weights.dequantize().to(dtype)
    compute = cpu_dense_method(dense, options.packs(dtype), options.row_invariant) or _DequantizedLinear(dense)
    return compute, options.row_invariant and not getattr(compute, "row_variant", False)


class _DequantizedLinear:
    """F.linear with a dense weight the method holds (the fallback where the int4 kernel does not serve)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


class IntWeightsMethod(QuantizedLinearMethod):
    """A linear layer holding integer groups: the checkpoint's tensors until loaded, then the int4 kernel's form."""

    bits: int

    def __init__(self) -> None:
        self.dtype = torch.get_default_dtype()  # the model's: layers are built inside the loader's dtype context
        self.compute: LinearMethod | None = None
        self.perm: torch.Tensor | None = None  # [K] input columns in the kernel's order
        self._rows_probe: tuple[int, int, int, torch.dtype] | None = None  # the int4 kernel's shape, once packed
        self._dense_invariant = True

    @property
    def row_invariant(self) -> bool:  # type: ignore[override]
        """Whether rows are bitwise independent of their number: probed (once per shape) for the int4 kernel; the
        dense fallback has it where batch-invariant mode gave it a row plan."""
        if self._rows_probe is None:
            return self._dense_invariant
        return int4_rows_invariant(*self._rows_probe, torch.get_num_threads())

    @property
    @abc.abstractmethod
    def checkpoint_tensors(self) -> tuple[str, ...]:
        """Names of the layer parameters in the checkpoint's form (freed after repacking)."""

    @abc.abstractmethod
    def int_weights(self, layer: LinearBase) -> IntWeights:
        """Unpack the layer's loaded checkpoint tensors."""

    def process_weights_after_loading(self, layer: LinearBase, options: LinearOptions) -> None:
        weights = self.int_weights(layer)
        free_checkpoint_tensors(layer, self.checkpoint_tensors)
        reason, packed = pack_int4(weights, self.dtype, options)
        if packed is not None:
            self.compute, self.perm = Int4LinearMethod(packed[0], None, exact=True), packed[1]
            self._rows_probe = (*weights.q.shape, packed[0].num_planes, self.dtype)
            return
        name = layer.prefix or type(layer).__name__
        log.warning("%s (%s) computes with a dense dequantized weight: %s", name, type(self).__name__, reason)
        self.compute, self._dense_invariant = dense_fallback(weights, self.dtype, options)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.compute is None:
            raise ModelLoadError(f"{layer.prefix}: {type(self).__name__} computes only after its weights are loaded")
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self.compute.apply(layer, x, bias)

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The dense weight: unpacked from the checkpoint's tensors before repacking, read back through the kernel
        (x = identity, one product per output: exact) after."""
        if self.compute is None:
            return self.int_weights(layer).dequantize()
        eye = torch.eye(layer.input_size, dtype=self.dtype)
        return self.apply(layer, eye, None).t().float()

    def __repr__(self) -> str:
        kernel = "unloaded" if self.compute is None else repr(self.compute)
        return f"{type(self).__name__}({self.bits}-bit, {kernel}{', act-order' if self.perm is not None else ''})"
