"""The `gguf` method: linear layers of a GGUF file computed from its quantized blocks, no dense copy kept.

The GGUF loader (llmplug.loaders.gguf_packed) chooses the modules whose linear weights stay packed and names
them in the config it builds (`quantization_config = {"quant_method": "gguf", "packed_modules": [...]}`); each
linear layer under one of them gets a `GGUFLinearMethod`. Its `qweight` parameter takes each checkpoint shard
(q, k, v; gate, up) as the loader yields it: the raw blocks of one GGUF type ([rows, bytes], uint8, the type
attached with `as_packed`) or, for a type the kernel does not implement, the dense rows. A Q4_K_M file mixes
types inside one fused layer (Q5_0 q and k with a Q8_0 v), so every shard keeps its own type; after loading,
neighbouring shards of one type are joined, and a call computes each run of rows with one kernel call
(`llmplug_cpu::gguf_matmul`: ggml's dequantization, float32 sums, every output row the same arithmetic
whatever the number of tokens) into its slice of the output. The IQ types look their weights up in tables (a grid
of int8 values, sign bytes); the kernel takes gguf-py's own (`lookup_tables`), read from its dequantizers.

The token embedding table and the LM head's table (the same one when tied) stay in their blocks too, as llama.cpp
keeps `token_embd.weight`: a lookup decodes only its rows (`packed_rows`, `llmplug_cpu::gguf_get_rows`, ggml's
get_rows) and the head computes its logits with `gguf_matmul` over the table (`GGUFTableMethod`); the vocabulary
layers (llmplug.layers.vocab_embedding) hold the blocks as their `weight`, marked with `as_packed`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from llmplug.core.errors import ModelLoadError
from llmplug.layers.kernels.native import native_available, ops
from llmplug.layers.weight_utils import ShardId, frozen_parameter
from llmplug.quantization.base import QuantizationConfig, QuantizedLinearMethod

if TYPE_CHECKING:
    from llmplug.layers.linear import LinearBase
    from llmplug.layers.quantization import LinearOptions

__all__ = [
    "GGUFConfig", "GGUFLinearMethod", "GGUFTableMethod", "IQ_TYPES", "KERNEL_TYPES", "as_packed", "lookup_tables",
    "packed_matmul", "packed_rows", "packed_table_shard", "packed_type",
]

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
# the types whose weights are looked up in tables, passed to the kernel from gguf-py's dequantizers (gguf.quants)
IQ_TYPES = frozenset({Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M})
# the GGUF types `llmplug_cpu::gguf_matmul` decodes (ops.cpp's gguf_type)
KERNEL_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}) | IQ_TYPES
_SIGNED = frozenset({Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS})  # the types storing 7-bit sign indices into ksigns
PARAM = "qweight"
_TYPE_ATTR = "_llmplug_gguf_type"


@functools.cache
def lookup_tables(qtype: Q) -> tuple[torch.Tensor, ...]:
    """The tables `gguf_matmul` reads for `qtype`, gguf-py's own: the int8 grid (IQ4: its 16 levels) and, for the types
    with sign indices, ksigns; () for the types without tables."""
    if qtype not in IQ_TYPES:
        return ()
    traits = getattr(gguf.quants, qtype.name)  # gguf-py's dequantizer of the type, which holds its tables
    if qtype in (Q.IQ4_NL, Q.IQ4_XS):
        values = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.int8)
    else:
        traits.init_grid()
        values = traits.grid.reshape(traits.grid_shape).astype(np.int8)  # small integers stored as float32
    tables = (torch.from_numpy(values.reshape(-1)),)
    if qtype in _SIGNED:
        tables += (torch.frombuffer(bytearray(gguf.quants.IQ2_XXS.ksigns), dtype=torch.uint8),)
    return tables


def as_packed(blocks: torch.Tensor, qtype: Q | None) -> torch.Tensor:
    """`blocks` ([rows, bytes] uint8) marked as raw GGUF blocks of `qtype`, for `GGUFLinearMethod`'s loader and the
    vocabulary layers (None: marked dense again, for a parameter that takes a dense table)."""
    setattr(blocks, _TYPE_ATTR, qtype)
    return blocks


def packed_type(tensor: torch.Tensor) -> Q | None:
    """The GGUF type `as_packed` gave `tensor`; None for a dense tensor."""
    return getattr(tensor, _TYPE_ATTR, None)


def packed_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: Q) -> torch.Tensor:
    """x [T, in] . dequant(blocks)^T -> [T, rows] in x's dtype (`gguf_matmul`; float16 goes through float32)."""
    tables = list(lookup_tables(qtype))
    if x.dtype not in (torch.float32, torch.bfloat16):  # the kernel reads float32 and bfloat16
        return ops().gguf_matmul(x.float(), blocks, int(qtype), tables).to(x.dtype)
    return ops().gguf_matmul(x, blocks, int(qtype), tables)


def packed_rows(blocks: torch.Tensor, qtype: Q, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ids [...] -> rows [..., cols] of dequant(blocks) in `dtype` (float32, bfloat16 or float16), decoding only those
    rows (`gguf_get_rows`): each gguf-py's dequantized row, rounded to `dtype`."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    flat = ids.reshape(-1)
    out = torch.empty(flat.shape[0], blocks.shape[1] // type_size * block_size, dtype=dtype)
    ops().gguf_get_rows(blocks, flat, int(qtype), list(lookup_tables(qtype)), out)
    return out.reshape(*ids.shape, out.shape[-1])


def packed_table_shard(loaded: torch.Tensor, cols: int, vocab: tuple[int, int, int, int], prefix: str) -> torch.Tensor:
    """This rank's rows of a packed [vocab, bytes] table, `vocab` = (vocabulary size, first row, end row, rows per
    rank), the padding rows past the vocabulary all-zero blocks (whose weights are 0); a ModelLoadError naming
    `prefix` when the table is not `cols` weights a row in blocks of its type."""
    qtype = packed_type(loaded)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    size, start, end, per_rank = vocab
    if loaded.dim() != 2 or cols % block_size or tuple(loaded.shape) != (size, cols // block_size * type_size):
        raise ModelLoadError(
            f"{prefix}: a {qtype.name} table of shape {tuple(loaded.shape)} (bytes) for a [{size}, {cols}] table; "
            "the GGUF file does not match its config"
        )
    if (start, end) == (0, size) and per_rank == size and loaded.is_contiguous():  # one rank: the blocks as they are
        return loaded
    shard = loaded.new_zeros(per_rank, loaded.shape[1])
    shard[: end - start] = loaded[start:end]
    return shard


class GGUFTableMethod:
    """The LM head's logits from its packed table (`layer.weight`, raw blocks of `qtype`; the embedding's when tied):
    `gguf_matmul`, each row of logits the same arithmetic whatever the batch, as llama.cpp computes its output."""

    row_invariant = True

    def __init__(self, qtype: Q) -> None:
        self.qtype = qtype

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[..., hidden] -> [..., rows of this rank's table] in x's dtype."""
        flat = x.reshape(-1, x.shape[-1])  # [T, hidden]
        y = packed_matmul(flat, layer.weight, self.qtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def __repr__(self) -> str:
        return f"gguf({self.qtype.name})"


@dataclass(slots=True)
class Segment:
    """Output rows [offset, offset + rows) of a layer: raw blocks of `qtype` [rows, bytes], or dense rows (None)."""

    offset: int
    qtype: Q | None
    data: torch.Tensor

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, rows] in x's dtype."""
        if self.qtype is None:
            return F.linear(x, self.data.to(x.dtype))
        return packed_matmul(x, self.data, self.qtype)

    def dequantize(self, in_features: int) -> torch.Tensor:
        """The dense rows [rows, in] in float32, by gguf-py's dequantizer (the format's reference)."""
        if self.qtype is None:
            return self.data.float()
        values = gguf.quants.dequantize(self.data.numpy(), self.qtype)
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(self.rows, in_features)


class GGUFLinearMethod(QuantizedLinearMethod):
    """A linear layer holding its checkpoint shards as GGUF blocks (each its own type), computed from them."""

    def __init__(self) -> None:
        self.shards: dict[ShardId | None, Segment] = {}
        self.segments: list[Segment] = []

    def create_weights(self, layer: LinearBase) -> None:
        """`qweight`: a placeholder whose loader keeps each shard's rows of this rank (sizes come with the tensors)."""

        def load(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
            self.load_shard(layer, loaded, shard_id)

        layer.register_parameter(PARAM, frozen_parameter(torch.empty(0, dtype=torch.uint8), load))

    def load_shard(self, layer: LinearBase, loaded: torch.Tensor, shard_id: ShardId | None) -> None:
        """Keep this rank's part of checkpoint tensor `loaded` (shard `shard_id`): its rows of the output slot and,
        for a row-parallel layer, its whole blocks of the input features."""
        qtype = packed_type(loaded)
        offset, size, index, count = layer._output_slot(shard_id)
        rank, ranks = layer.input_split
        width = layer.input_size if qtype is None else _row_bytes(qtype, layer.input_size, layer)
        rows = _slice(loaded, 0, index, size, count, "output features")
        what = "input features" if qtype is None else f"bytes of {qtype.name} blocks"
        data = _slice(rows, 1, rank, width, ranks, what).contiguous()
        if data.untyped_storage().nbytes() > data.nbytes:  # this rank's part of a larger tensor: only it is kept
            data = data.clone()
        self.shards[shard_id] = Segment(offset, qtype, data)

    def process_weights_after_loading(self, layer: LinearBase, options: LinearOptions) -> None:
        """Join neighbouring shards of one type into one kernel call; without the kernels, dense rows."""
        segments = _joined(sorted(self.shards.values(), key=lambda s: s.offset))
        self.shards = {}
        if any(s.qtype is not None for s in segments) and not native_available():
            log.info("%s: llmplug's CPU kernels are not built; its GGUF blocks are dequantized", layer.prefix)
            dense = torch.cat([s.dequantize(layer.input_size) for s in segments])
            segments = [Segment(0, None, dense.to(torch.get_default_dtype()))]
        self.segments = segments

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[..., in] -> [..., out]: each segment's rows from its blocks, into its slice of the output."""
        flat = x.reshape(-1, x.shape[-1])  # [T, in]
        parts = [s.matmul(flat) for s in self.segments]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [T, out]
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The dense [out, in] float32 weight of the layer, by gguf-py's dequantizer."""
        return torch.cat([s.dequantize(layer.input_size) for s in self.segments])

    def __repr__(self) -> str:
        types = ",".join(s.qtype.name if s.qtype is not None else "dense" for s in self.segments)
        return f"GGUFLinearMethod({types})"


def _row_bytes(qtype: Q, in_features: int, layer: LinearBase) -> int:
    """Bytes of one row of `in_features` weights of `qtype`; a ModelLoadError when they are not whole blocks."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if in_features % block_size:
        raise ModelLoadError(
            f"{layer.prefix}: {in_features} input features per rank are not whole {qtype.name} blocks of {block_size} "
            f"(tensor_parallel_size={layer.tp_size}); choose a tensor-parallel size that splits the blocks, or "
            "quantization=none to compute this GGUF densely"
        )
    return in_features // block_size * type_size


def _slice(tensor: torch.Tensor, dim: int, index: int, size: int, count: int, what: str) -> torch.Tensor:
    """Slice `index` of `count` slices of `size` along `dim`; a ModelLoadError when the tensor's length differs."""
    if tensor.dim() != 2 or tensor.shape[dim] != size * count:
        raise ModelLoadError(
            f"tensor of shape {tuple(tensor.shape)} should have {size * count} {what} along dim {dim}; "
            "the GGUF file does not match its config"
        )
    return tensor.narrow(dim, index * size, size)


def _joined(segments: list[Segment]) -> list[Segment]:
    """Neighbouring segments of one GGUF type as one (a fused layer of one type is one kernel call)."""
    joined: list[Segment] = []
    for s in segments:
        last = joined[-1] if joined else None
        adjacent = last is not None and last.offset + last.rows == s.offset
        if adjacent and last.qtype is not None and last.qtype == s.qtype:
            joined[-1] = Segment(last.offset, s.qtype, torch.cat([last.data, s.data]))
        else:
            joined.append(s)
    return joined


class GGUFConfig(QuantizationConfig):
    """A GGUF file's packed linear layers: every linear layer under one of `packed_modules` keeps its blocks."""

    name = "gguf"

    def __init__(self, packed_modules: frozenset[str]) -> None:
        self.packed_modules = packed_modules

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GGUFConfig:
        """`packed_modules`: the module names (e.g. `model.layers.0.mlp`) whose linear layers stay packed."""
        modules = config.get("packed_modules")
        if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
            raise ModelLoadError(f"a gguf quantization_config needs packed_modules, a list of module names: {config}")
        return cls(frozenset(modules))

    def linear_method(self, layer: LinearBase, prefix: str) -> QuantizedLinearMethod | None:
        """A `GGUFLinearMethod` for a linear layer whose parent module is packed; None (dense) otherwise."""
        return GGUFLinearMethod() if prefix.rpartition(".")[0] in self.packed_modules else None

    def check_experts(self, prefix: str) -> None:
        """Experts are never among `packed_modules` (the loader dequantizes them): they load dense."""

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        """The kernel reads float32 and bfloat16 activations (float16 goes through float32)."""
        return (torch.float32, torch.bfloat16, torch.float16)
