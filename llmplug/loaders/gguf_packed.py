"""Which linear weights of a GGUF file stay in their quantized blocks (the `gguf` quantization method), and
those blocks as tensors.

A module (e.g. `model.layers.0.mlp`) is packed when one of its linear weights has a type of `TRIGGER_TYPES`;
then all its linear weights go to its layers' `GGUFLinearMethod` under `<name>.qweight`: as raw blocks when
the kernel implements their type, else dense (logged). Whole modules, because a fused layer (gate/up, q/k/v)
takes all its shards one way. Linear weights are those of the transformers model's `nn.Linear` modules, less
its output embedding (llmplug's head is not a linear layer); only architectures whose llmplug module names
are transformers' (`PACKED_ARCHES`) are packed, so the names the loader yields are those the model's layers
hold. `quantization`: auto (the default) and none pack the types the int4 path has no exact form of (K-quants,
Q5_0/Q5_1, the IQ types, and the Q4_0/Q4_1/Q8_0 tensors beside them), and a file with packed modules gets no
int4 copies; a file of only Q4_0/Q4_1/Q8_0 is dense (none) or keeps the exact int4 path (auto) as before; gguf
packs every type the kernel implements; int4 and int8 (llmplug's own copies of dense weights) dequantize every tensor.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn

from llmplug.core.errors import ModelLoadError
from llmplug.quantization.gguf import KERNEL_TYPES, PARAM, as_packed

__all__ = ["PACKED_ARCHES", "PackedPlan", "linear_weight_names", "packed_blocks", "plan_packing"]

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType
# llama.cpp architectures whose llmplug modules carry transformers' names (no checkpoint-name translation)
PACKED_ARCHES = frozenset({"llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3"})
_INT4_EXACT = frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0})  # the auto mode's exact int4 path keeps files of only these
# none (the default) and auto: a K-quant or IQ file is a quantized checkpoint, computed by its method as a gptq one
TRIGGER_TYPES = {"none": KERNEL_TYPES - _INT4_EXACT, "auto": KERNEL_TYPES - _INT4_EXACT, "gguf": KERNEL_TYPES}


@dataclass(frozen=True, slots=True)
class PackedPlan:
    """The HF weight names yielded packed (as `<module>.qweight`) and the modules that hold them."""

    weights: frozenset[str] = frozenset()
    modules: frozenset[str] = frozenset()

    def quantization_config(self) -> dict[str, Any]:
        """The `quantization_config` the loader gives the hf config (read by `GGUFConfig.from_config`)."""
        return {"quant_method": "gguf", "packed_modules": sorted(self.modules)}

    def packed_name(self, hf_name: str) -> str | None:
        """`<module>.qweight` for a packed weight, else None."""
        return f"{hf_name.rpartition('.')[0]}.{PARAM}" if hf_name in self.weights else None


def linear_weight_names(hf_config: Any) -> frozenset[str]:
    """`<module>.weight` of every `nn.Linear` of the transformers model of `hf_config` but its output embedding."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    head = model.get_output_embeddings()
    linear = (name for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head)
    return frozenset(f"{name}.weight" for name in linear)


def plan_packing(arch: str, types: dict[str, Q], linear: frozenset[str], quantization: str) -> PackedPlan:
    """The plan for a file of `arch` whose HF-named tensors have `types`, under `quantization`."""
    trigger = TRIGGER_TYPES.get(quantization)
    if trigger is None or arch not in PACKED_ARCHES:
        if trigger is not None and any(t in trigger for t in types.values()):
            log.info("GGUF architecture %s: linear layers dequantized (packed blocks serve %s)", arch,
                     ", ".join(sorted(PACKED_ARCHES)))
        return PackedPlan()
    candidates = [name for name in types if name in linear]
    modules = frozenset(name.rsplit(".", 2)[0] for name in candidates if types[name] in trigger)
    weights = frozenset(name for name in candidates if name.rsplit(".", 2)[0] in modules)
    dense = Counter(types[name].name for name in weights if types[name] not in KERNEL_TYPES)
    if dense:
        log.info("GGUF linear weights of types the packed kernel does not implement, dequantized: %s",
                 ", ".join(f"{count} {name}" for name, count in sorted(dense.items())))
    return PackedPlan(weights, modules)


def packed_blocks(tensor: Any, hf_name: str, shape: tuple[int, ...] | None) -> torch.Tensor:
    """The raw blocks of 2-D GGUF `tensor` as [out, bytes] uint8 (its own memory), marked with its type; a
    ModelLoadError naming the tensor when its size is not that of `shape` ([out, in], the model's) in blocks."""
    qtype = tensor.tensor_type
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = (int(dim) for dim in reversed(tensor.shape))
    data = np.asarray(tensor.data)
    expected = None if shape is None else shape[0] * (shape[1] // block_size) * type_size
    if shape is None or (rows, cols) != tuple(shape) or cols % block_size or data.nbytes != expected:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name} ({hf_name}): {data.nbytes} bytes of {qtype.name} for a {rows}x{cols} weight; "
            f"the model needs {shape} ({expected} bytes): the file is damaged or does not match its config"
        )
    return as_packed(torch.from_numpy(np.array(data, dtype=np.uint8).reshape(rows, -1)), qtype)
