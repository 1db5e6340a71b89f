"""The `gguf` loader: one llama.cpp .gguf file holds the config, the tokenizer and the weights.

The file is memory-mapped with `gguf.GGUFReader`; the transformers config is built from its metadata
(`gguf_config`), the tokenizer by transformers from its tokenizer metadata (chat template included),
and each tensor is dequantized to the model dtype only when the model asks for it. See docs/gguf.md.

Q4_0, Q4_1 and Q8_0 tensors can also carry their exact int4 form (`int4_groups_of_tensor`, read from
the raw blocks) to the layers, which keep a packed int4 copy for small batches (docs/quantization.md).
With `quantization` auto (the default), none or gguf, the linear weights of K-quant files stay in their blocks
instead (`gguf_packed`, computed by the `gguf` quantization method): no dense copy is made of them, and
such a file gets no int4 copies. Its token embedding and output tables stay in their blocks too (`packed_tables`),
as llama.cpp keeps them: the vocabulary layers look rows up and compute the logits from the blocks; its other
tensors (norms, biases, experts) are dense.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import gguf
import numpy as np
import torch
from tqdm import tqdm

from llmplug.core.cache import cache_dir
from llmplug.core.errors import ModelLoadError
from llmplug.layers.kernels.native import native_available
from llmplug.layers.quantization import INT4_GROUP_SIZE, Int4Groups, attach_int4_groups
from llmplug.loaders.base import BaseModelLoader, model_dtype
from llmplug.loaders.default_model import resolve_model_path
from llmplug.loaders.gguf_config import (
    ROPE_FREQS_TENSOR,
    GGUFArchitecture,
    architecture_of,
    build_hf_config,
    field_value,
    gguf_generation_config,
)
from llmplug.loaders.gguf_packed import PackedPlan, linear_weight_names, packed_blocks, plan_packing
from llmplug.quantization.gguf import KERNEL_TYPES, as_packed, packed_type

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from llmplug.core.config import ModelConfig

__all__ = [
    "GGUFLoader",
    "gguf_file",
    "exact_int4_types",
    "hf_tensor_name",
    "int4_groups_of_tensor",
    "iter_gguf_weights",
    "load_gguf_config",
    "load_gguf_tokenizer",
    "open_gguf",
    "packed_plan",
    "packed_tables",
    "reverse_permute_qk",
    "tensor_names",
    "undo_conversion",
]

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

CONFIG_ONLY_TENSORS = frozenset({ROPE_FREQS_TENSOR})  # read into the config, not model weights
TABLE_TENSORS = frozenset({"token_embd.weight", "output.weight"})  # the vocabulary tables (kept packed with the plan)
Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------- reading and validating the file


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """A validated, memory-mapped reader of `path` (cached per process while the file is unchanged)."""
    path = os.path.abspath(path)
    try:
        stat = os.stat(path)
    except OSError as error:
        raise ModelLoadError(f"GGUF file {path} cannot be read: {error.strerror}.") from error
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    """Parse once per (path, mtime, size): parsing the tokenizer arrays of a real model takes seconds."""
    _check_magic(path)
    try:
        reader = _PlainViewReader(path, "r")
    # GGUFReader reports a damaged header or tensor table as any of these while decoding it.
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, MemoryError) as error:
        raise ModelLoadError(f"GGUF file {path} is truncated or corrupted: {error}") from error
    _check_tensor_extents(reader, path, size)
    _check_not_split(reader, path)
    return reader


class _PlainViewReader(gguf.GGUFReader):
    """`gguf.GGUFReader` over a plain ndarray view of its memory map: the reader slices the map once per field
    part (millions of times for a 262k-token vocabulary), and each slice of an `np.memmap` pays the subclass's
    bookkeeping; plain views of the same pages parse a real model's metadata 3-4x faster."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)  # the view keeps the map open


def _check_magic(path: str) -> None:
    """Refuse a file that does not start with the GGUF magic before handing it to the parser."""
    try:
        with open(path, "rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as error:
        raise ModelLoadError(f"GGUF file {path} cannot be read: {error.strerror}.") from error
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path} is not a GGUF file: it starts with {magic!r}, expected {GGUF_MAGIC!r}.")


def _check_tensor_extents(reader: gguf.GGUFReader, path: str, size: int) -> None:
    """Every tensor's bytes must lie inside the file (a truncated download fails here, not in numpy)."""
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != tensor.n_bytes:
            raise ModelLoadError(
                f"GGUF file {path} is truncated: tensor {tensor.name} ends at byte {end}, "
                f"but the file has {size} bytes."
            )


def _check_not_split(reader: gguf.GGUFReader, path: str) -> None:
    """Split GGUFs (model-00001-of-0000N.gguf) are not merged by this loader."""
    count = field_value(reader, "split.count", 1)
    if count > 1:
        part = field_value(reader, "split.no", 0) + 1
        raise ModelLoadError(
            f"GGUF file {path} is part {part} of {count} of a split model; merge the parts with "
            "`llama-gguf-split --merge` first."
        )


def gguf_file(model: str) -> str:
    """The .gguf file named by `model`: a path, a folder holding one .gguf, or an embedded model's name."""
    path = Path(resolve_model_path(model))
    if path.is_dir():
        path = _single_gguf_in(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF model {model!r}: no such file ({path}).")
    return str(path)


def _single_gguf_in(folder: Path) -> Path:
    """The only .gguf file in `folder`; ModelLoadError when there are none or several."""
    candidates = sorted(folder.glob("*.gguf"))
    if len(candidates) != 1:
        names = ", ".join(candidate.name for candidate in candidates) or "none"
        raise ModelLoadError(f"Folder {folder} must hold exactly one .gguf file (found: {names}); pass the file.")
    return candidates[0]


# ---------------------------------------------------------------- tokenizer


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer stored in the GGUF file, with its chat template (cached per process).

    The cached object is shared by every caller in the process; treat it as read-only.
    """
    path = os.path.abspath(path)
    open_gguf(path)  # a missing or damaged file fails here with a ModelLoadError
    stat = os.stat(path)
    return _tokenizer_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _tokenizer_cached(path: str, mtime_ns: int, size: int) -> PreTrainedTokenizerBase:
    """Build once per (path, mtime, size) in the process, and once per file's metadata on this machine: converting
    a vocabulary takes transformers a second parse of the file and seconds (a 262k-token one, tens of seconds)."""
    reader = open_gguf(path)
    tokenizer = _converted_tokenizer(reader, path)
    template = field_value(reader, "tokenizer.chat_template")
    if template is not None:
        tokenizer.chat_template = template  # the file's template is the model's; never a default one
    return tokenizer


def _converted_tokenizer(reader: gguf.GGUFReader, path: str) -> PreTrainedTokenizerBase:
    """transformers' conversion of the file's tokenizer, kept in llmplug's cache (`core.cache`) under the hash of
    the file's metadata and the converting libraries' versions; a cache that cannot be read or written is
    converted again, never an error."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    key = hashlib.blake2b(reader.data[: reader.data_offset].tobytes(), digest_size=16)
    key.update(f"{transformers.__version__} {tokenizers.__version__}".encode())
    cached = cache_dir() / "gguf_tokenizers" / key.hexdigest()
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception as error:  # whatever damage the copy has (a parse error from Rust included): convert
            log.info("cached tokenizer %s unreadable (%s): converting the file's again", cached, error)
            shutil.rmtree(cached, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    except (ValueError, KeyError, NotImplementedError, OSError) as error:
        raise ModelLoadError(f"GGUF file {path}: its tokenizer cannot be built: {error}") from error
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent, suffix=".tmp"))
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(cached)  # atomic; a concurrent start that got there first keeps its copy
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        log.info("tokenizer of %s not cached (%s): it is converted again next start", path, error)
    return tokenizer


# ---------------------------------------------------------------- weights


def tensor_names(path: str) -> dict[str, str]:
    """llama.cpp tensor name -> HF checkpoint name for every tensor the file's architecture can hold.

    The names come from gguf-py's own table (`gguf.get_tensor_name_map`, the one llama.cpp's converter
    writes with) applied to the checkpoint names of the transformers model of the file's config, built
    on the meta device; a name the table does not know is left out, so the file's tensor fails by name.
    """
    path = os.path.abspath(path)
    stat = os.stat(path)
    return _tensor_names_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _tensor_names_cached(path: str, mtime_ns: int, size: int) -> dict[str, str]:
    reader = open_gguf(path)
    arch, _ = architecture_of(reader, path)
    checkpoint = checkpoint_shapes(path)
    table = gguf.get_tensor_name_map(_GGUF_ARCHES[arch], build_hf_config(reader, path).num_hidden_layers)
    names = {}
    for hf_name in [*checkpoint, *_per_projection_expert_names(checkpoint)]:
        stem, suffix = _stem_and_suffix(hf_name)
        parts = stem.split(".")
        # the table knows some names only without the base-model prefix (Bloom's converter strips `transformer.`)
        gguf_stem = next(filter(None, (table.get_name(".".join(parts[i:])) for i in range(len(parts)))), None)
        if gguf_stem is not None:
            names.setdefault(f"{gguf_stem}.{suffix}", hf_name)
        elif (whole := table.get_name(hf_name)) is not None:  # a parameter without a leaf (Mamba's A_log, D)
            names.setdefault(whole, hf_name)
    return names


def _stem_and_suffix(hf_name: str) -> tuple[str, str]:
    """`owner.module.weight` -> (`owner.module`, `weight`); a parameter named `<x>_bias` (transformers' stacked
    expert biases, e_score_correction_bias) is the bias of `<x>`, as llama.cpp's converter names it."""
    stem, suffix = hf_name.rsplit(".", 1)
    if suffix.endswith("_bias"):
        return f"{stem}.{suffix.removesuffix('_bias')}", "bias"
    return stem, suffix


# transformers' stacked expert parameters -> the per-projection tensors llama.cpp stores them as
_STACKED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
EXPERT_PROJECTIONS = frozenset({"gate_proj", "up_proj", "down_proj"})


def _per_projection_expert_names(checkpoint: dict[str, tuple[int, ...]]) -> list[str]:
    """`<owner>.experts.<proj>.weight|bias` for every stacked `<owner>.experts.gate_up_proj[_bias]` / `down_proj`:
    llama.cpp keeps gate, up and down as three [E, out, in] tensors (`ffn_gate_exps`, ...)."""
    names = []
    for hf_name in checkpoint:
        owner, _, leaf = hf_name.rpartition(".")
        param = leaf.removesuffix("_bias")
        if owner.endswith(".experts") and param in _STACKED_EXPERTS:
            suffix = "bias" if leaf.endswith("_bias") else "weight"
            names += [f"{owner}.{proj}.{suffix}" for proj in _STACKED_EXPERTS[param]]
    return names


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes of the transformers model of the file's config (built on the meta device)."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    return _checkpoint_shapes_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _checkpoint_shapes_cached(path: str, mtime_ns: int, size: int) -> dict[str, tuple[int, ...]]:
    from transformers import AutoModelForCausalLM

    config = build_hf_config(open_gguf(path), path)
    with torch.device("meta"):
        state = AutoModelForCausalLM.from_config(config).state_dict()
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


_GGUF_ARCHES = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


def hf_tensor_name(name: str, names: dict[str, str]) -> str:
    """The HF checkpoint name of a llama.cpp tensor name (blk.3.attn_q.weight -> model.layers.3....)."""
    if name in names:
        return names[name]
    raise ModelLoadError(f"GGUF tensor {name!r} has no known Hugging Face name (unsupported tensor).")


def reverse_permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row interleave: per head, rows (i, pair) back to HF's (pair, i) order."""
    head_rows = weight.shape[0] // num_heads
    # weight: [num_heads * head_dim, ...] -> [num_heads, head_dim / 2, 2, ...] -> swap the last two
    pairs = weight.reshape(num_heads, head_rows // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


@functools.lru_cache(maxsize=None)
def can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    """True when `gguf.quants.dequantize` implements `qtype` (probed on one zero block)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def check_tensors(reader: gguf.GGUFReader, path: str) -> None:
    """Fail before loading anything when a tensor has an unknown name or a type that cannot be dequantized."""
    names = tensor_names(path)
    for tensor in reader.tensors:
        if not can_dequantize(tensor.tensor_type):
            raise ModelLoadError(
                f"GGUF file {path}: tensor {tensor.name} has type {tensor.tensor_type.name}, "
                "which the gguf package cannot dequantize."
            )
        if tensor.name not in CONFIG_ONLY_TENSORS:
            try:
                hf_tensor_name(tensor.name, names)
            except ModelLoadError as error:
                raise ModelLoadError(f"GGUF file {path}: {error}") from None


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as fp32 in torch's dimension order (GGUF lists dimensions reversed)."""
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # float32
    if not values.flags.writeable:  # F32 is a view of the read-only memory map: torch needs its own copy
        values = values.copy()
    return torch.from_numpy(values.reshape(shape))


def undo_conversion(spec: GGUFArchitecture, name: str, weight: torch.Tensor, num_heads: int) -> torch.Tensor | None:
    """The HF checkpoint form of a tensor llama.cpp's converter changed (other than the Q/K permute), else None."""
    if spec.norm_offset and name.endswith("norm.weight"):
        return weight - spec.norm_offset  # the converter folded the model's `offset + w` into the weight
    if spec.conv1d and weight.dim() == 2 and name.rsplit(".", 2)[-2] in _CONV1D_TENSORS:
        return weight.t().contiguous()  # back to Conv1D's [in, out]
    if spec.ssm_a_log and name.rsplit(".", 1)[-1] == "ssm_a":
        return torch.log(-weight)  # the converter stored A = -exp(A_log)
    if spec.qkv_contiguous and name.rsplit(".", 2)[-2] == "attn_qkv":
        # [q | k | v] (each [heads * d, ...]) -> per head (q, k, v): [heads, 3, d, ...]
        return weight.reshape(3, num_heads, -1, *weight.shape[1:]).transpose(0, 1).reshape(weight.shape)
    return None


_CONV1D_TENSORS = frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"})


def iter_gguf_weights(
    path: str, dtype: torch.dtype, progress: bool = True, int4_types: frozenset[Q] = frozenset(),
    plan: PackedPlan = PackedPlan(), tables: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for every weight of the file, dequantized one at a time.

    Matrices of a type in `int4_types` also carry their exact int4 groups (`attach_int4_groups`); the
    weights of `plan` come as `<module>.qweight`, raw blocks where the kernel implements their type; the
    tables named in `tables` (HF names, `packed_tables`) come as their raw blocks under their own names.
    """
    reader = open_gguf(path)
    check_tensors(reader, path)
    arch, spec = architecture_of(reader, path)
    names = tensor_names(path)
    head_counts = _qk_head_counts(reader, path) if spec.permute_qk else {}
    num_heads = field_value(reader, f"{arch}.attention.head_count")
    shapes = checkpoint_shapes(path)
    tensors = [tensor for tensor in reader.tensors if tensor.name not in CONFIG_ONLY_TENSORS]
    for tensor in tqdm(tensors, desc=f"Loading {os.path.basename(path)}", unit="tensor", disable=not progress):
        name = hf_tensor_name(tensor.name, names)
        if (packed_name := plan.packed_name(name)) is not None:
            yield packed_name, _packed_weight(tensor, name, shapes.get(name), head_counts, dtype)
            continue
        if name in tables:
            yield name, packed_blocks(tensor, name, shapes.get(name))
            continue
        weight = dequantize_tensor(tensor)
        if _is_per_projection_experts(name):
            yield from _per_expert(name, undo_conversion(spec, tensor.name, weight, num_heads) or weight, dtype)
            continue
        weight = _as_shape(weight, shapes.get(name))
        groups = int4_groups_of_tensor(tensor) if tensor.tensor_type in int4_types and weight.dim() == 2 else None
        if (qk_heads := _permuted_heads(name, head_counts)) is not None:
            weight = reverse_permute_qk(weight, qk_heads)
            groups = groups.map_rows(functools.partial(reverse_permute_qk, num_heads=qk_heads)) if groups else None
        elif (fixed := undo_conversion(spec, tensor.name, weight, num_heads)) is not None:
            weight, groups = fixed, None  # int4 groups would need the same change (docs/models.md)
        weight = weight.to(dtype)
        yield name, (attach_int4_groups(weight, groups) if groups is not None else weight)


def _packed_weight(
    tensor: Any, name: str, shape: tuple[int, ...] | None, head_counts: dict[str, int], dtype: torch.dtype
) -> torch.Tensor:
    """A weight of the packed plan in HF row order: its raw blocks, or dense in `dtype` for a type the kernel
    lacks. Only the Q/K row permute applies (`PACKED_ARCHES` need no other change), and it moves whole rows."""
    if tensor.tensor_type in KERNEL_TYPES:
        weight = packed_blocks(tensor, name, shape)
    else:
        weight = _as_shape(dequantize_tensor(tensor), shape).to(dtype)
    if (qk_heads := _permuted_heads(name, head_counts)) is not None:
        qtype = packed_type(weight)
        weight = reverse_permute_qk(weight, qk_heads)
        weight = as_packed(weight.contiguous(), qtype) if qtype is not None else weight
    return weight


def packed_plan(path: str, quantization: str) -> PackedPlan:
    """The linear weights of the file that stay in their blocks under `quantization` (cached per file)."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    return _packed_plan_cached(path, stat.st_mtime_ns, stat.st_size, quantization)


@functools.lru_cache(maxsize=4)
def _packed_plan_cached(path: str, mtime_ns: int, size: int, quantization: str) -> PackedPlan:
    reader = open_gguf(path)
    arch, _ = architecture_of(reader, path)
    names = tensor_names(path)
    types = {names[t.name]: t.tensor_type for t in reader.tensors if t.name in names and len(t.shape) == 2}
    return plan_packing(arch, types, linear_weight_names(build_hf_config(reader, path)), quantization)


def packed_tables(path: str, quantization: str) -> frozenset[str]:
    """The HF names of the file's vocabulary tables (token embedding, output) that stay in their blocks under
    `quantization`: those of a type the kernels implement, in a file whose linear layers are packed, when the
    kernels are built (else every table is dense)."""
    if not packed_plan(path, quantization).modules or not native_available():
        return frozenset()
    names = tensor_names(path)
    return frozenset(
        names[t.name] for t in open_gguf(path).tensors
        if t.name in TABLE_TENSORS and t.name in names and t.tensor_type in KERNEL_TYPES
    )


def _is_per_projection_experts(hf_name: str) -> bool:
    """Whether `hf_name` is one projection of every expert (`<owner>.experts.gate_proj.weight`, [E, ...])."""
    parts = hf_name.split(".")
    return len(parts) >= 3 and parts[-3] == "experts" and parts[-2] in EXPERT_PROJECTIONS


def _per_expert(hf_name: str, stacked: torch.Tensor, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """[E, ...] of `<owner>.experts.<proj>.<leaf>` -> `<owner>.experts.<e>.<proj>.<leaf>` per expert (the names
    of a transformers checkpoint that stores experts one by one, which every MoE model here loads)."""
    owner, proj, leaf = hf_name.rsplit(".", 2)
    stacked = stacked.to(dtype)
    for e in range(stacked.shape[0]):
        yield f"{owner}.{e}.{proj}.{leaf}", stacked[e]


def _as_shape(weight: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    """`weight` in the transformers parameter's shape when llama.cpp only dropped or added size-1 dims
    (a conv weight [C, K] of [C, 1, K], Qwen2-MoE's shared-expert gate [hidden] of [1, hidden])."""
    if shape is None or tuple(weight.shape) == shape or weight.numel() != math.prod(shape):
        return weight
    if [d for d in weight.shape if d != 1] != [d for d in shape if d != 1]:
        return weight  # a real mismatch: the model's loader names it
    return weight.reshape(shape)


# ---------------------------------------------------------------- exact int4 form of Q4_0 / Q4_1 / Q8_0


def exact_int4_types(quantization: str) -> frozenset[Q]:
    """The GGUF types whose exact int4 groups the loader hands to the layers under `quantization`.

    auto: every type int4 planes hold exactly (Q4_0, Q4_1 in one plane, Q8_0 in two); int4: the 4-bit
    ones only (the layers quantize the rest to one plane); none: no types.
    """
    return {"auto": frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0}), "int4": frozenset({Q.Q4_0, Q.Q4_1})}.get(
        quantization, frozenset()
    )


def int4_groups_of_tensor(tensor: Any) -> Int4Groups:
    """The exact int4 groups of a Q4_0, Q4_1 or Q8_0 matrix, read from its raw blocks (torch order, unpermuted)."""
    decode = _BLOCK_DECODERS.get(tensor.tensor_type)
    if decode is None:
        raise ValueError(f"GGUF type {tensor.tensor_type.name} has no exact int4 form")
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    if block_size != INT4_GROUP_SIZE:  # a guard for the table above, not a file property
        raise ValueError(f"GGUF type {tensor.tensor_type.name} has blocks of {block_size}, not {INT4_GROUP_SIZE}")
    n, k = (int(dim) for dim in reversed(tensor.shape))
    blocks = np.asarray(tensor.data).reshape(n, k // block_size, type_size)  # [N, G, bytes per block]
    q, scale, zero = decode(blocks)  # [P, N, G, 32] uint8, [P, N, G] float32 twice
    planes = q.shape[0]
    q_tensor = torch.from_numpy(np.ascontiguousarray(q).reshape(planes, n, k))
    return Int4Groups(q_tensor, torch.from_numpy(scale), torch.from_numpy(zero), block_size)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of every block, as float32 [N, G]."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout: byte j holds weight j (low nibble) and weight j + 16 (high nibble)."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [..., 32]


def _decode_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0: w = d * (q - 8): scale d, zero 0."""
    d = _half(blocks, 0)
    return _nibbles(blocks[..., 2:18])[None], d[None], np.zeros_like(d)[None]


def _decode_q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1: w = d * q + m = d * (q - 8) + (m + 8 d): scale d, zero m + 8 d."""
    d, m = _half(blocks, 0), _half(blocks, 2)
    return _nibbles(blocks[..., 4:20])[None], d[None], (m + 8 * d)[None]


def _decode_q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_0: w = d * q8 with q8 + 128 = 16 hi + lo, so w = 16 d (hi - 8) + [d (lo - 8) + 8 d]: two planes."""
    d = _half(blocks, 0)
    biased = (blocks[..., 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [N, G, 32] 0..255
    q = np.stack([biased >> 4, biased & 0x0F])
    return q, np.stack([16 * d, d]), np.stack([np.zeros_like(d), 8 * d])


_BLOCK_DECODERS = {Q.Q4_0: _decode_q4_0, Q.Q4_1: _decode_q4_1, Q.Q8_0: _decode_q8_0}


def _permuted_heads(hf_name: str, head_counts: dict[str, int]) -> int | None:
    """The head count to unpermute `hf_name` with (q_proj/k_proj weight or bias), else None."""
    module = hf_name.rsplit(".", 2)[-2]  # model.layers.N.self_attn.<module>.<weight|bias>
    return head_counts.get(module)


def _qk_head_counts(reader: gguf.GGUFReader, path: str) -> dict[str, int]:
    """Heads per permuted projection: Q uses n_head, K uses n_head_kv (as llama.cpp's convert does)."""
    arch, _ = architecture_of(reader, path)
    num_heads = field_value(reader, f"{arch}.attention.head_count")
    num_kv_heads = field_value(reader, f"{arch}.attention.head_count_kv", num_heads)
    return {"q_proj": num_heads, "k_proj": num_kv_heads}


def load_gguf_config(path: str, hf_overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """The transformers config of the GGUF file, with `hf_overrides` applied."""
    config = build_hf_config(open_gguf(path), path)
    config.update(dict(hf_overrides or {}))
    return config


# ---------------------------------------------------------------- the loader plugin


class GGUFLoader(BaseModelLoader):
    """`load.format: gguf`: the config, tokenizer and weights all come from one .gguf file."""

    def gguf_path(self, model_config: ModelConfig) -> str:
        """The .gguf file of `model_config.model` (a file, a folder holding one, or an embedded name)."""
        return gguf_file(self.model_path(model_config.model))

    def download_model(self, model_config: ModelConfig) -> None:
        """Fail now, before workers start, unless the file is a readable GGUF this loader can run."""
        path = self.gguf_path(model_config)
        load_gguf_config(path)
        check_tensors(open_gguf(path), path)

    def load_hf_config(self, model_config: ModelConfig) -> PretrainedConfig:
        """The transformers config built from the file's metadata, with `hf_overrides` applied; with linear weights
        that stay in their blocks, its `quantization_config` names the `gguf` method and their modules."""
        path = self.gguf_path(model_config)
        config = load_gguf_config(path, model_config.hf_overrides)
        plan = packed_plan(path, model_config.quantization)
        if plan.modules:
            config.quantization_config = plan.quantization_config()
        return config

    def load_tokenizer(self, model_config: ModelConfig) -> PreTrainedTokenizerBase:
        """The file's own tokenizer and chat template, unless `model_config.tokenizer` names another."""
        if model_config.tokenizer is not None:
            return super().load_tokenizer(model_config)
        return load_gguf_tokenizer(self.gguf_path(model_config))

    def load_generation_config(self, model_config: ModelConfig) -> dict[str, Any]:
        """The end-of-sequence ids llama.cpp stops at: the file's eos, end-of-turn and end-of-message tokens."""
        return gguf_generation_config(open_gguf(self.gguf_path(model_config)))

    def iter_weights(self, model_config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights in the model dtype, dequantized lazily (the base class shows the progress bar)."""
        path, dtype = self.gguf_path(model_config), model_dtype(model_config.dtype)
        plan = packed_plan(path, model_config.quantization)
        # a file with packed layers gets no int4 copies: they would only add memory (an int4 copy of Gemma 3's
        # Q8_0 embedding as its head decodes 8x slower than the dense head here: benchmarks/gguf_kquants.py)
        int4_types = frozenset() if plan.modules else exact_int4_types(model_config.quantization)
        # llmplug's vocabulary layers take packed tables; transformers' own (the transformers backend) dense ones
        native = model_config.model_impl != "transformers"
        tables = packed_tables(path, model_config.quantization) if native else frozenset()
        return iter_gguf_weights(path, dtype, progress=False, int4_types=int4_types, plan=plan, tables=tables)
