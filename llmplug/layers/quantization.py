"""Weight-only int4: a packed 4-bit copy of a layer's weight, used for decode.

Decoding one token reads every weight once, so its cost is the bytes of the weights; torch's CPU
int4 kernel (`_weight_int4pack_mm_for_cpu`) reads a quarter of bf16's bytes but does more work per
weight, so it wins for a few tokens and loses for many. A layer therefore keeps its dense weight and
may carry an int4 copy next to it; its `quant_method` picks one per call by the number of tokens.

The seam (after vLLM's quant_method):

- every linear layer and the LM head compute through `layer.quant_method.apply(layer, x, bias)`;
  `DENSE` (F.linear) until told otherwise;
- a checkpoint loader may attach the exact int4 form of a tensor to the tensor it yields
  (`attach_int4_groups`); the layer's own weight_loader places those groups in the same rows as the
  dense weight (fused projections and tensor-parallel shards included) in a staging area on the
  parameter (`stage_int4`);
- after loading, `process_weights_after_loading(model, options)` lets each layer pack its staged (or,
  when asked, freshly quantized) groups and switch to `Int4LinearMethod`; staging is then dropped. The copy is
  llmplug's own kernel (`NativeInt4`, row invariant by construction) where rows must not depend on their batch,
  else torch's (`PackedInt4`, the fastest for a few rows).
  Layers that stay dense get their weight packed for oneDNN where that is faster (layers/packed_linear.py).

The int4 form: `Int4Groups` with planes p, w[n, k] = sum_p (q_p[n, k] - 8) * scale_p[n, g] + zero_p[n, g],
g = k // group_size, q in 0..15 — exactly the kernel's dequantization (checked in the tests). One
plane holds GGUF Q4_0 / Q4_1 blocks exactly; two planes hold Q8_0 exactly (high and low nibble).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.core.errors import ModelLoadError
from llmplug.layers.forward_context import GeneratedRows, current_generated_rows
from llmplug.layers.kernels.int4_matmul import NATIVE_INT4_DTYPES, NativeInt4, native_int4_available
from llmplug.layers.kernels.w4a8 import W4A8, w4a8_enabled
from llmplug.layers.int8_linear import Int8LinearMethod, int8_matmul_exact
from llmplug.layers.packed_linear import cpu_dense_method
from llmplug.layers.row_invariance import remembered_probe

__all__ = [
    "DENSE",
    "DenseLinearMethod",
    "INT4_GROUP_SIZE",
    "INT4_MAX_TOKENS",
    "Int4Groups",
    "Int4LinearMethod",
    "LinearMethod",
    "LinearOptions",
    "PackedInt4",
    "attach_int4_groups",
    "int4_groups_of",
    "int4_kernel_supported",
    "int4_rows_invariant",
    "linear_method_for",
    "process_weights_after_loading",
    "quantize_int4",
    "splits_generated_rows",
    "stage_int4",
]

log = logging.getLogger(__name__)

INT4_GROUP_SIZE = 32  # GGUF's block size, so Q4_0/Q4_1/Q8_0 blocks map onto groups one to one
# The most tokens per call that take the int4 kernel; more take the dense matmul. Measured on SmolLM2's
# shapes (bf16, AVX-512, 2 threads): see docs/quantization.md.
INT4_MAX_TOKENS = 8
INT4_ROWS = ("small", "all", "generated")  # which rows an int4 layer computes in int4 (Int4LinearMethod)
_INNER_K_TILES = 2  # an argument of the packing op that the CPU kernel does not use
_N_MULTIPLE = 16  # the CPU packing op needs whole blocks of 16 output rows

# A source of shard placement: copies the rows (or columns) of a checkpoint tensor that belong to this
# layer's shard into a tensor shaped like the layer's weight, as the layer's weight_loader does.
Place = Callable[[torch.Tensor, torch.Tensor], None]


# ---------------------------------------------------------------- the int4 form of a weight


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """w[n, k] = sum_p (q[p, n, k] - 8) * scale[p, n, k // group_size] + zero[p, n, k // group_size]."""

    q: torch.Tensor  # [P, N, K] uint8, values 0..15
    scale: torch.Tensor  # [P, N, K // group_size] float32
    zero: torch.Tensor  # [P, N, K // group_size] float32
    group_size: int

    @property
    def num_planes(self) -> int:
        """How many int4 planes add up to the weight (1: Q4_0/Q4_1/quantized, 2: Q8_0)."""
        return self.q.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The weight these groups encode, [N, K] float32."""
        scale = self.scale.repeat_interleave(self.group_size, dim=-1)
        zero = self.zero.repeat_interleave(self.group_size, dim=-1)
        return ((self.q.float() - 8) * scale + zero).sum(0)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Int4Groups":
        """Apply a row permutation `fn` ([N, ...] -> [N, ...]) to every plane (groups run along K: they stay whole)."""
        planes = [(fn(self.q[p]), fn(self.scale[p]), fn(self.zero[p])) for p in range(self.num_planes)]
        q, scale, zero = (torch.stack(parts) for parts in zip(*planes))
        return Int4Groups(q, scale, zero, self.group_size)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Groups:
    """Asymmetric groupwise 4-bit quantization of a dense [N, K] weight (round to nearest, min/max range)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 quantization needs in_features ({k}) divisible by the group size {group_size}")
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)  # [N, G]
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((groups - low.unsqueeze(-1)) / safe.unsqueeze(-1)).round_().clamp_(0, 15).to(torch.uint8)
    zero = low + 8 * scale  # (q - 8) * scale + zero = low + q * scale
    return Int4Groups(q.reshape(1, n, k), scale.unsqueeze(0), zero.unsqueeze(0), group_size)


# ---------------------------------------------------------------- carrying groups through weight loading


def attach_int4_groups(tensor: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    """Mark `tensor` (a dense checkpoint weight) as exactly equal to `groups`; returns the tensor.

    Like `weight_loader` on parameters, the groups ride on the tensor object, so they reach the layer's
    weight_loader through any model's `load_weights` loop unchanged; a model that transforms the tensor
    first simply loses them, and the layer stays dense.
    """
    tensor.int4_groups = groups  # type: ignore[attr-defined]
    return tensor


def int4_groups_of(tensor: torch.Tensor) -> Int4Groups | None:
    """The exact int4 groups a loader attached to `tensor`, or None."""
    return getattr(tensor, "int4_groups", None)


@dataclass(slots=True)
class _Staging:
    """The int4 groups of one weight parameter, assembled shard by shard during loading."""

    q: torch.Tensor  # [P, N, K] uint8
    scale: torch.Tensor  # [P, N, G] float32
    zero: torch.Tensor  # [P, N, G] float32
    filled: torch.Tensor  # [N, G] bool: which groups came from the checkpoint
    group_size: int

    @classmethod
    def for_weight(cls, weight: torch.Tensor, group_size: int) -> "_Staging":
        n, k = weight.shape
        groups = (1, n, k // group_size)
        q = torch.full((1, n, k), 8, dtype=torch.uint8)  # (8 - 8) * 0 + 0: an empty plane adds nothing
        zeros = torch.zeros(groups)
        return cls(q, zeros, zeros.clone(), torch.zeros(groups[1:], dtype=torch.bool), group_size)

    def ensure_planes(self, num_planes: int) -> None:
        """Grow to `num_planes` planes with empty ones (a fused weight may mix Q4 and Q8_0 shards)."""
        extra = num_planes - self.q.shape[0]
        if extra > 0:
            self.q = torch.cat([self.q, torch.full((extra, *self.q.shape[1:]), 8, dtype=torch.uint8)])
            self.scale = torch.cat([self.scale, self.scale.new_zeros(extra, *self.scale.shape[1:])])
            self.zero = torch.cat([self.zero, self.zero.new_zeros(extra, *self.zero.shape[1:])])

    def groups(self) -> Int4Groups:
        return Int4Groups(self.q, self.scale, self.zero, self.group_size)


def stage_int4(param: nn.Parameter, loaded_weight: torch.Tensor, place: Place) -> None:
    """Place the int4 groups attached to `loaded_weight` (if any) where `place` puts the dense rows.

    Called by a layer's weight_loader right after it placed the dense tensor with the same `place`.
    """
    source = int4_groups_of(loaded_weight)
    if source is None:
        return
    staging: _Staging | None = getattr(param, "int4_staging", None)
    if staging is None:
        if param.shape[-1] % source.group_size:  # e.g. a tensor-parallel slice that cuts groups: stay dense
            return
        staging = param.int4_staging = _Staging.for_weight(param, source.group_size)  # type: ignore[attr-defined]
    elif staging.group_size != source.group_size:
        raise ModelLoadError(
            f"int4 shards of one weight have group sizes {staging.group_size} and {source.group_size}"
        )
    staging.ensure_planes(source.num_planes)
    for p in range(source.num_planes):
        place(staging.q[p], source.q[p])
        place(staging.scale[p], source.scale[p])
        place(staging.zero[p], source.zero[p])
    place(staging.filled, torch.ones_like(source.scale[0], dtype=torch.bool))


def staged_int4(param: torch.Tensor) -> _Staging | None:
    """The int4 staging area of a weight parameter, or None."""
    return getattr(param, "int4_staging", None)


def drop_int4_staging(param: torch.Tensor) -> None:
    """Free a parameter's staging area (after packing, or when int4 is not used)."""
    if hasattr(param, "int4_staging"):
        del param.int4_staging


# ---------------------------------------------------------------- the kernel


@functools.lru_cache(maxsize=None)
def int4_kernel_supported(device_type: str, dtype: torch.dtype) -> bool:
    """True when torch's int4 weight-only kernel runs on `device_type` for `dtype` (probed on a tiny weight)."""
    try:
        device = torch.device(device_type)
        q = torch.zeros(_N_MULTIPLE, INT4_GROUP_SIZE, dtype=torch.int32, device=device)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        scales = torch.ones(1, _N_MULTIPLE, 2, dtype=dtype, device=device)
        x = torch.ones(1, INT4_GROUP_SIZE, dtype=dtype, device=device)
        torch._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP_SIZE, scales)
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        log.info("int4 weight-only kernel unavailable on %s for %s: %s", device_type, dtype, error)
        return False
    return True


# Row counts whose rows the row-invariance probe compares with the same rows among _PROBED_ROWS: a lone row,
# the kernel's row blocks and odd counts around them
_PROBED_ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 33, 64, 65, 128)
_PROBED_ROWS = 257


@functools.lru_cache(maxsize=None)
def int4_rows_invariant(
    out_features: int, in_features: int, num_planes: int, dtype: torch.dtype, num_threads: int
) -> bool:
    """Whether the int4 kernel gives each row of x the same bits whatever the number of rows (1 to 257, on a
    random weight of this shape; `num_threads`, torch's thread count, is part of the cache key). Remembered on
    disk per machine (`remembered_probe`): the LM head's probe takes seconds.

    The rows are built to show any change of summation order: each holds +2^10 and -2^10 at two columns
    with (before quantization) equal weights, so those products nearly cancel while the small terms summed
    between them lose low bits to the large running sum, by how many depending on the order.
    """
    dtype_name = str(dtype).removeprefix("torch.")
    name = f"int4-{out_features}x{in_features}x{num_planes}-{dtype_name}"
    return bool(remembered_probe(name, lambda: _probe_int4_rows(out_features, in_features, num_planes, dtype)))


def _probe_int4_rows(out_features: int, in_features: int, num_planes: int, dtype: torch.dtype) -> bool:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(_PROBED_ROWS, in_features, generator=generator)
    for row in range(x.shape[0]):
        first, last = row % 4, in_features - 1 - row % 4
        weight[:, last] = weight[:, first]
        x[row, first], x[row, last] = 2.0**10, -(2.0**10)
    one = quantize_int4(weight)  # the planes side by side: the kernel's K grows as for a two-plane weight
    groups = Int4Groups(*(t.repeat(num_planes, 1, 1) for t in (one.q, one.scale, one.zero)), one.group_size)
    packed = PackedInt4.pack(groups, dtype, torch.device("cpu"))
    x = x.to(dtype)
    every_row = packed.matmul(x)
    return all(torch.equal(packed.matmul(x[:m]), every_row[:m]) for m in _PROBED_ROW_COUNTS)


@dataclass(frozen=True, slots=True)
class PackedInt4:
    """An [N, K] weight in the kernel's layout: planes side by side along K, x repeated once per plane."""

    weight: torch.Tensor  # [N, P * K / 2] uint8, packed by _convert_weight_to_int4pack_for_cpu
    scales_and_zeros: torch.Tensor  # [P * K / group_size, N, 2] in the activation dtype
    group_size: int
    num_planes: int

    @classmethod
    def pack(cls, groups: Int4Groups, dtype: torch.dtype, device: torch.device) -> "PackedInt4":
        """Pack `groups` for activations of `dtype` (the scales are rounded to it)."""
        planes, n, _ = groups.q.shape
        q = torch.cat(list(groups.q), dim=1).to(device=device, dtype=torch.int32)  # [N, P * K]
        scale = torch.cat(list(groups.scale), dim=1).t()  # [P * G, N]
        zero = torch.cat(list(groups.zero), dim=1).t()
        packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), _INNER_K_TILES)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).to(device=device, dtype=dtype).contiguous()
        return cls(packed, scales_and_zeros, groups.group_size, planes)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """[M, K] -> [M, N]; accumulates in float32 inside the kernel."""
        if self.num_planes > 1:
            x = x.repeat(1, self.num_planes)  # [M, P * K]: each plane sees the same activations
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.weight, self.group_size, self.scales_and_zeros)


def packable(groups: Int4Groups) -> str | None:
    """Why the kernel cannot take these groups, or None when it can."""
    n = groups.q.shape[1]
    if n % _N_MULTIPLE:
        return f"{n} output features are not a multiple of {_N_MULTIPLE}"
    return None


# ---------------------------------------------------------------- linear methods


class LinearMethod(Protocol):
    """How a layer computes x W^T + b; the layer calls `apply` in its forward."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[..., K] -> [..., N] with `layer.weight` ([N, K]) or a copy of it in another form."""
        ...


class DenseLinearMethod:
    """F.linear with the layer's dense weight."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def __repr__(self) -> str:
        return "dense"


DENSE = DenseLinearMethod()


class Int4LinearMethod:
    """The int4 kernel for some rows of x, the `dense` method for the others. Which rows, by `rows` (default: "all"
    when `max_tokens` is None, else "small"):

    - "small": every row of a call of at most `max_tokens` rows (decode of a few streams), none of a larger one:
      the fastest at every batch size, but a row's bits depend on its batch;
    - "all": every row (the kernel probed row invariant for the shape: batch invariant);
    - "generated": the rows of generated tokens (`GeneratedRows` of the step: positions at or past their request's
      prompt), prompt rows dense. Batch invariant with both kernels row invariant: a token's kernel follows from
      its position, and a call outside a step that names its rows computes every row densely, as a prompt.
    """

    def __init__(
        self, packed: PackedInt4 | NativeInt4 | W4A8, max_tokens: int | None, exact: bool, dense: LinearMethod = DENSE,
        rows: str | None = None,
    ) -> None:
        rows = rows or ("all" if max_tokens is None else "small")
        if rows not in INT4_ROWS:
            raise ValueError(f"int4 rows must be one of {INT4_ROWS}, got {rows!r}")
        self.packed, self.max_tokens, self.exact, self.dense, self.rows = packed, max_tokens, exact, dense, rows

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # called ~120 times per decode step: the common case (2-D x) does no reshaping
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [M, K]
        if self.rows == "small" and rows.shape[0] > self.max_tokens:
            return self.dense.apply(layer, x, bias)
        if self.rows == "generated":
            generated = current_generated_rows()
            if generated is None or generated.num_rows != rows.shape[0] or generated.count == 0:
                return self.dense.apply(layer, x, bias)
            if generated.count < rows.shape[0]:
                y = self._split(layer, rows, bias, generated)
                return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
        y = self._int4(rows, bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def _int4(self, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.packed.matmul(rows)  # [M, N]
        if bias is not None:
            y += bias
        return y

    def _split(
        self, layer: nn.Module, rows: torch.Tensor, bias: torch.Tensor | None, generated: GeneratedRows
    ) -> torch.Tensor:
        """A step of prompt and generated rows: each part through its kernel, scattered back in place."""
        decoded = self._int4(rows.index_select(0, generated.index), bias)
        prompted = self.dense.apply(layer, rows.index_select(0, generated.prompt_index), bias)
        y = decoded.new_empty(rows.shape[0], decoded.shape[1])
        y.index_copy_(0, generated.index, decoded)
        y.index_copy_(0, generated.prompt_index, prompted)
        return y

    def __repr__(self) -> str:
        source = "exact" if self.exact else "quantized"
        rows = f"m<={self.max_tokens}" if self.rows == "small" else f"{self.rows} rows"
        return f"int4({rows}, {source}, planes={self.packed.num_planes})"


# ---------------------------------------------------------------- after loading


@dataclass(frozen=True, slots=True)
class LinearOptions:
    """What `process_weights_after_loading` does.

    int4: use the int4 kernel where the checkpoint holds exact int4 groups (quantization=auto); int4_rows: for
    which rows (Int4LinearMethod: "small", "all" or "generated"; the last two need the kernel row invariant;
    None: "all" in the batch-invariant mode, else "small").
    int8: every layer computes through int8 weights and per-token int8 activations (quantization=int8,
    layers/int8_linear.py); overrides int4.
    quantize_dense: also quantize weights (or groups of them) that have no exact int4 form; False keeps
    such layers dense. required: fail when the int4 kernel is missing instead of staying dense.
    prepack: pack dense weights for oneDNN where that is supported (see layers/packed_linear.py).
    row_invariant: no layer's result rows may depend on the number of rows (batch-invariant mode): float32
    weights are packed for oneDNN too, whose kernel keeps that (MKL's float32 matmul does not), dense weights
    are called by their row plans, and an int4 copy is used only where the kernel is probed row invariant for
    the weight's shape ("small" rows are then refused); a layer whose probe fails stays dense.
    """

    int4: bool = True
    int4_rows: str | None = None
    int8: bool = False
    quantize_dense: bool = False
    required: bool = False
    group_size: int = INT4_GROUP_SIZE
    max_tokens: int = INT4_MAX_TOKENS
    prepack: bool = True
    row_invariant: bool = False

    def packs(self, dtype: torch.dtype) -> bool:
        """Whether dense weights of `dtype` should be packed for oneDNN (where the platform supports it)."""
        return (self.prepack and dtype != torch.float32) or self.row_invariant


def linear_method_for(weight: torch.Tensor, options: LinearOptions) -> LinearMethod:
    """The method a layer with dense `weight` (and maybe staged int4 groups) should use after loading."""
    if options.int8 and weight.dim() == 2:
        return Int8LinearMethod(weight)
    if not (options.int4 and int4_kernel_supported(weight.device.type, weight.dtype)):
        return _dense_method_for(weight, options)
    staging = staged_int4(weight)
    if staging is not None and bool(staging.filled.all()):
        groups, exact = staging.groups(), True
    elif not options.quantize_dense:
        return _dense_method_for(weight, options)
    else:
        groups, exact = _fill_by_quantizing(weight, staging, options.group_size), False
    rows = options.int4_rows or ("all" if options.row_invariant else "small")
    if options.row_invariant and rows == "small":
        raise ValueError("int4 rows 'small' depend on their batch: the batch-invariant mode takes 'all' or 'generated'")
    packed = _pack_int4(weight, groups, options, rows)
    if packed is None:
        return _dense_method_for(weight, options)
    if rows == "all":  # one kernel for every row count: no dense fallback to pack
        return Int4LinearMethod(packed, None, exact)
    return Int4LinearMethod(packed, options.max_tokens, exact, _dense_method_for(weight, options), rows=rows)


def _pack_int4(
    weight: torch.Tensor, groups: Int4Groups, options: LinearOptions, rows: str
) -> PackedInt4 | NativeInt4 | W4A8 | None:
    """The int4 copy's kernel: llmplug's own (row invariant by construction) wherever a row's bits must not depend on
    its batch and it is built -- for bfloat16 and Q4_0 / Q4_1 blocks W4A8 (int8 activations, as llama.cpp; the
    fastest at every row count), else NativeInt4 (bf16 or float32 activations, the file's weights exactly); else
    torch's (the fastest for a few rows), probed row invariant for the shape in the batch-invariant mode; None where
    none can take the weight (logged)."""
    if rows != "small" and weight.device.type == "cpu" and weight.dtype in NATIVE_INT4_DTYPES \
            and native_int4_available():
        w4a8 = W4A8.pack(groups) if weight.dtype == torch.bfloat16 and w4a8_enabled() else None
        return w4a8 or NativeInt4.pack(groups, weight.dtype)
    reason = packable(groups)
    if reason is None and options.row_invariant and not int4_rows_invariant(
        *weight.shape, groups.num_planes, weight.dtype, torch.get_num_threads()
    ):
        reason = "the int4 kernel's rows depend on their number for this shape (batch-invariant mode)"
    if reason is not None:
        if options.quantize_dense or options.row_invariant:
            log.warning("weight of shape %s stays dense: %s", tuple(weight.shape), reason)
        return None
    return PackedInt4.pack(groups, weight.dtype, weight.device)


def _dense_method_for(weight: torch.Tensor, options: LinearOptions) -> LinearMethod:
    method = cpu_dense_method(weight, options.packs(weight.dtype), options.row_invariant) if weight.dim() == 2 else None
    return DENSE if method is None else method


def _fill_by_quantizing(weight: torch.Tensor, staging: _Staging | None, group_size: int) -> Int4Groups:
    """Quantize `weight`; where some groups were staged exactly from the checkpoint, keep those."""
    quantized = quantize_int4(weight, staging.group_size if staging is not None else group_size)
    if staging is None:
        return quantized
    filled = staging.filled  # [N, G]
    staging.ensure_planes(1)
    q_filled = filled.repeat_interleave(staging.group_size, dim=-1)  # [N, K]
    q = staging.q.clone()
    q[0] = torch.where(q_filled, staging.q[0], quantized.q[0])
    scale, zero = staging.scale.clone(), staging.zero.clone()
    scale[0] = torch.where(filled, staging.scale[0], quantized.scale[0])
    zero[0] = torch.where(filled, staging.zero[0], quantized.zero[0])
    return Int4Groups(q, scale, zero, staging.group_size)


def process_weights_after_loading(model: nn.Module, options: LinearOptions, only_dense: bool = False) -> None:
    """Let every linear layer choose its method (int4 copy, packed or plain dense); then free all staging.

    Called by the loader once `model.load_weights` is done, and again after a weight update with
    `only_dense`: then only layers computing densely (a new weight makes its layer dense) are redone.
    """
    param = next(model.parameters(), None)
    if options.int8 and param is not None and not int8_matmul_exact(param.device.type):
        raise ModelLoadError(
            f"quantization=int8 needs an exact int8 matmul (torch._int_mm) on {param.device.type}, which is not "
            "available here; use quantization=none"
        )
    supported = param is not None and int4_kernel_supported(param.device.type, param.dtype)
    if not supported and options.required:
        where = f"{param.device.type} / {param.dtype}" if param is not None else "this model"
        raise ModelLoadError(
            f"quantization=int4 needs torch's int4 weight-only kernel, which is not available for {where}; "
            "use quantization=auto or none"
        )
    for module in model.modules():
        hook = getattr(module, "process_weights_after_loading", None)
        if hook is not None and not (only_dense and getattr(module, "quant_method", DENSE) is not DENSE):
            hook(options)
    for param in model.parameters():
        drop_int4_staging(param)
    _log_summary(model)


def splits_generated_rows(model: nn.Module) -> bool:
    """Whether some layer of `model` picks its kernel by a token's position (int4 rows "generated"): the engine then
    tells each step which rows are generated tokens, and names the KV blocks those rows computed apart."""
    return any(
        isinstance(getattr(module, "quant_method", None), Int4LinearMethod) and module.quant_method.rows == "generated"
        for module in model.modules()
    )


def _log_summary(model: nn.Module) -> None:
    methods = [m.quant_method for m in model.modules() if hasattr(m, "quant_method")]
    int4 = [m for m in methods if isinstance(m, Int4LinearMethod)]
    if int4:
        exact = sum(m.exact for m in int4)
        rows = {"small": f"calls of up to {int4[0].max_tokens} tokens", "all": "every token",
                "generated": "generated tokens (prompts dense)"}[int4[0].rows]
        log.info("int4 weight-only path for %s: %d of %d linear layers (%d exact from the checkpoint)",
                 rows, len(int4), len(methods), exact)
