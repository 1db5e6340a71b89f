"""bitsandbytes weights for the linear layers: 4-bit (nf4, fp4) and 8-bit (LLM.int8()).

The seam is the int4 one (layers/quantization.py): a loader attaches a `BnbSource` to each checkpoint
tensor it yields (`attach_bnb`) — either the tensor's bitsandbytes form read from a pre-quantized
checkpoint, or the settings to quantize it with. Only linear layers consume it: their weight_loader
quantizes the tensor if asked (one checkpoint tensor at a time, as transformers does) and stages the
form with the same placement as the dense rows (`stage_bnb`), so a fused qkv_proj gets the q, k and v
forms side by side and a tensor-parallel shard gets its rows or columns. After loading,
`apply_bitsandbytes(model)` gives every staged layer a bitsandbytes module (Linear4bit / Linear8bitLt
around the staged data) as its quant method, and the quantized parameter replaces the dense weight.
Layers that got no form (the LM head; modules a checkpoint left unquantized) stay dense.

The form is row-aligned so `place` can cut it like the weight: 4-bit data [N, K / 2] (two codes per
byte) with absmax [N, K / blocksize] — blocks never cross rows, so K must be a multiple of the block
size; 8-bit data [N, K] int8 with one scale per row [N] (SCB).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Literal

import torch
from torch import nn

from llmplug.core.errors import ModelLoadError

if TYPE_CHECKING:
    from bitsandbytes.functional import QuantState

__all__ = [
    "BnbLinearMethod",
    "BnbRows",
    "BnbSettings",
    "BnbSource",
    "apply_bitsandbytes",
    "attach_bnb",
    "stage_bnb",
]

QuantType = Literal["nf4", "fp4", "int8"]
Place = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True, slots=True)
class BnbSettings:
    """How weights are (or were) quantized: 4-bit nf4 / fp4 in blocks, or 8-bit per row."""

    quant_type: QuantType = "nf4"
    blocksize: int = 64
    double_quant: bool = False  # 4-bit: quantize the absmax values too (bnb's compress_statistics)
    int8_threshold: float = 6.0  # 8-bit: activation outliers above it take a 16-bit matmul

    @property
    def is_4bit(self) -> bool:
        return self.quant_type != "int8"

    def quantize(self, weight: torch.Tensor) -> "BnbRows":
        """The form of one [N, K] weight, by bitsandbytes' own quantization kernels."""
        import bitsandbytes.functional as bnbf

        n, k = weight.shape
        if not self.is_4bit:
            data, scale, _ = bnbf.int8_vectorwise_quant(weight.contiguous().to(torch.float16))
            return BnbRows(data, scale, self, None, weight.dtype)
        _check_blocks(k, self.blocksize)
        packed, state = bnbf.quantize_4bit(
            weight.contiguous(), blocksize=self.blocksize, compress_statistics=self.double_quant,
            quant_type=self.quant_type,
        )
        return BnbRows.from_4bit(packed, state, self)


def _check_blocks(in_features: int, blocksize: int) -> None:
    if in_features % blocksize:
        raise ModelLoadError(
            f"bitsandbytes 4-bit: in_features {in_features} is not a multiple of the block size {blocksize}, "
            "so blocks would cross rows and the weight could not be fused or sharded"
        )


@dataclass(frozen=True, slots=True)
class BnbRows:
    """The bitsandbytes form of one [N, K] weight, as tensors whose rows are the weight's rows."""

    data: torch.Tensor  # 4-bit: [N, K // 2] uint8; 8-bit: [N, K] int8
    scale: torch.Tensor  # 4-bit: [N, K // blocksize] float32 absmax; 8-bit: [N] float32 (SCB)
    settings: BnbSettings
    code: torch.Tensor | None  # 4-bit: the 16 values of the quant map
    dtype: torch.dtype  # the dtype the weight had when it was quantized

    @classmethod
    def from_4bit(cls, packed: torch.Tensor, state: "QuantState", settings: BnbSettings) -> "BnbRows":
        """From bnb's packed [N * K / 2, 1] data and QuantState (nested absmax is expanded to float)."""
        import bitsandbytes.functional as bnbf

        n, k = state.shape
        _check_blocks(k, state.blocksize)
        absmax = state.absmax
        if state.nested:  # exactly what dequantize_4bit computes before its kernel
            absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
        settings = replace(settings, quant_type=state.quant_type, blocksize=state.blocksize)
        rows = packed.reshape(n, k // 2), absmax.float().reshape(n, k // state.blocksize)
        return cls(*rows, settings, state.code, state.dtype)

    @property
    def in_features(self) -> int:
        """K of the dense [N, K] weight."""
        return self.data.shape[1] * 2 if self.settings.is_4bit else self.data.shape[1]

    def widths(self, in_features: int) -> tuple[int, int | None]:
        """Row widths of data and scale for a weight with `in_features` columns (None: scale is 1-D)."""
        if not self.settings.is_4bit:
            return in_features, None
        return in_features // 2, in_features // self.settings.blocksize


@dataclass(frozen=True, slots=True)
class BnbSource:
    """What a loader attaches to a checkpoint tensor: its form, or the settings to make it with."""

    rows: BnbRows | None = None
    settings: BnbSettings | None = None

    def rows_for(self, tensor: torch.Tensor, dtype: torch.dtype) -> BnbRows:
        """The form of `tensor` (cast to the model's `dtype` first when quantizing it now)."""
        if self.rows is not None:
            return self.rows
        return self.settings.quantize(tensor.to(dtype))


def attach_bnb(tensor: torch.Tensor, source: BnbSource) -> torch.Tensor:
    """Let `source` ride on `tensor` through any model's load_weights loop to the linear layers; returns it."""
    tensor.bnb_source = source  # type: ignore[attr-defined]
    return tensor


# ---------------------------------------------------------------- staging in the layer's weight_loader


@dataclass(slots=True)
class _BnbStaging:
    """One weight parameter's form, assembled shard by shard during loading."""

    data: torch.Tensor
    scale: torch.Tensor
    filled: torch.Tensor  # [N] bool: rows that got a form
    first: BnbRows  # settings, quant map and dtype every shard must share

    @classmethod
    def for_weight(cls, weight: torch.Tensor, rows: BnbRows) -> "_BnbStaging":
        n, k = weight.shape
        data_width, scale_width = rows.widths(k)
        scale_shape = (n, scale_width) if scale_width is not None else (n,)
        return cls(
            torch.empty(n, data_width, dtype=rows.data.dtype),
            torch.empty(scale_shape, dtype=torch.float32),
            torch.zeros(n, dtype=torch.bool),
            rows,
        )


def stage_bnb(param: nn.Parameter, loaded_weight: torch.Tensor, place: Place) -> None:
    """Stage the form of `loaded_weight` (if a loader attached one) where `place` puts its dense rows.

    Called by a linear layer's weight_loader right after it placed the dense tensor with the same `place`.
    """
    source: BnbSource | None = getattr(loaded_weight, "bnb_source", None)
    if source is None:
        return
    rows = source.rows_for(loaded_weight, param.dtype)
    staging: _BnbStaging | None = getattr(param, "bnb_staging", None)
    if staging is None:
        staging = param.bnb_staging = _BnbStaging.for_weight(param, rows)  # type: ignore[attr-defined]
    elif staging.first.settings != rows.settings:
        raise ModelLoadError(
            f"bitsandbytes shards of one weight were quantized differently: {staging.first.settings} and {rows.settings}"
        )
    place(staging.data, rows.data)
    place(staging.scale, rows.scale.float())
    place(staging.filled, torch.ones(rows.data.shape[0], dtype=torch.bool))


# ---------------------------------------------------------------- the linear method


class BnbLinearMethod:
    """Computes through a bitsandbytes Linear4bit / Linear8bitLt module that holds the quantized weight."""

    def __init__(self, module: nn.Module, settings: BnbSettings) -> None:
        self.module, self.settings = module, settings

    @property
    def weight(self) -> nn.Parameter:
        """The quantized parameter (Params4bit or Int8Params)."""
        return self.module.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.module(x)  # [..., N]; bnb keeps the input dtype
        return y + bias if bias is not None else y

    def __repr__(self) -> str:
        return f"bitsandbytes({self.settings.quant_type})"


def _linear_4bit(staging: _BnbStaging, out_features: int, in_features: int, dtype: torch.dtype) -> nn.Module:
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    first = staging.first
    state = QuantState(
        absmax=staging.scale.reshape(-1), shape=torch.Size((out_features, in_features)), code=first.code,
        blocksize=first.settings.blocksize, quant_type=first.settings.quant_type, dtype=first.dtype,
    )
    with torch.device("meta"):  # no dense weight is allocated: ours replaces it
        module = bnb.nn.Linear4bit(
            in_features, out_features, bias=False, compute_dtype=dtype, quant_type=first.settings.quant_type
        )
    module.weight = bnb.nn.Params4bit(
        staging.data.reshape(-1, 1), requires_grad=False, quant_state=state, blocksize=first.settings.blocksize,
        compress_statistics=False, quant_type=first.settings.quant_type, module=module, bnb_quantized=True,
    )
    return module.eval()


def _linear_8bit(staging: _BnbStaging, out_features: int, in_features: int) -> nn.Module:
    import bitsandbytes as bnb

    threshold = staging.first.settings.int8_threshold
    with torch.device("meta"):
        module = bnb.nn.Linear8bitLt(
            in_features, out_features, bias=False, has_fp16_weights=False, threshold=threshold
        )
    data = staging.data.contiguous()
    module.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False, CB=data, SCB=staging.scale)
    return module.eval()


def bnb_method_for(weight: nn.Parameter) -> BnbLinearMethod | None:
    """The method for a weight with a complete staged form; None when nothing was staged (stays dense)."""
    staging: _BnbStaging | None = getattr(weight, "bnb_staging", None)
    if staging is None:
        return None
    del weight.bnb_staging
    n, k = weight.shape
    if not bool(staging.filled.all()):
        missing = int((~staging.filled).sum())
        raise ModelLoadError(
            f"{missing} of {n} rows of a fused weight have no bitsandbytes form: the checkpoint quantized only "
            "some of the projections this layer fuses"
        )
    if staging.first.settings.is_4bit:
        module = _linear_4bit(staging, n, k, weight.dtype)
    else:
        module = _linear_8bit(staging, n, k)
    return BnbLinearMethod(module, staging.first.settings)


def apply_bitsandbytes(model: nn.Module) -> int:
    """Give every linear layer with a staged form its bitsandbytes method; returns how many got one."""
    from llmplug.layers.linear import LinearBase

    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            method = bnb_method_for(module.weight)
            if method is not None:
                module.use_quantized(method, method.weight)
                count += 1
    return count
