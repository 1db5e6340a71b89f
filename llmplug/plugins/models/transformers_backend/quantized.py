"""Quantized checkpoints on the transformers backend: each `nn.Linear` of transformers' model that the checkpoint's
method quantizes becomes llmplug's `ReplicatedLinear`, built inside the loader's `building_with(method)` on the
engine's device (as the tensor-parallel layers are, so their parameters keep their weight loaders). It holds the
checkpoint's packed tensors under the checkpoint's own names (`q_proj.qweight`, `weight_packed`, fp8 `weight` and
`weight_scale_inv`, GGUF `qweight`) and computes with the method's kernel, exactly as a native model's layers do:
one compute path, no dense copy. A linear the method leaves dense (its ignore list, the output embedding) stays
transformers' `nn.Linear`.

A quantized checkpoint of a model holding a mixture of experts as stacked tensors (transformers' `[experts, ...]`
parameters, no linear layers) is refused by name: those tensors are dense here, and a method's quantized experts
need llmplug's own experts layer (the native implementation). A GGUF file's vocabulary tables, which the loader
yields in their blocks for llmplug's own embedding and head, reach transformers' dense `nn.Embedding` / head
dequantized by gguf-py, as transformers' own load of the file holds them (`load_dense`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmplug.core.errors import ModelLoadError
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.weight_utils import default_weight_loader
from llmplug.quantization import QuantizedLinearMethod, checkpoint_quant_method

__all__ = ["apply_quantized_linears", "load_dense"]


def apply_quantized_linears(model: nn.Module, config: Any, device: torch.device) -> list[str]:
    """Replace, in `model` (still on meta), each nn.Linear the method being built with quantizes by a
    ReplicatedLinear built on `device` carrying that method; returns the replaced modules' names (none for a dense
    checkpoint)."""
    found = checkpoint_quant_method(config)
    if found is None:
        return []
    head = model.get_output_embeddings()
    replaced = []
    for qualname, module in list(model.named_modules()):
        if _holds_stacked_experts(module):
            raise ModelLoadError(
                f"{qualname}: the transformers backend holds {type(model).__name__}'s experts as transformers' stacked "
                f"dense tensors, so a {found[0]!r} checkpoint of it cannot load there; run it with model_impl='native' "
                "(where llmplug has the architecture) or use the model's dense checkpoint"
            )
        if type(module) is not nn.Linear or module is head:
            continue
        with device:  # a layer the method leaves dense is dropped unused (its weight never touched, never resident)
            layer = ReplicatedLinear(module.in_features, module.out_features, module.bias is not None, prefix=qualname)
        if isinstance(layer.quant_method, QuantizedLinearMethod):
            parent, _, child = qualname.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
            replaced.append(qualname)
    return replaced


def _holds_stacked_experts(module: nn.Module) -> bool:
    """Whether `module` holds its own 3-D parameters (transformers' stacked experts, [experts, out, in]; a 1-D
    convolution's weight is 3-D too, and no experts)."""
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return False
    return any(param.dim() == 3 for param in module.parameters(recurse=False))


def load_dense(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy checkpoint tensor `loaded` into transformers' dense parameter `param`; raw GGUF blocks (a packed
    vocabulary table, uint8) are dequantized first by gguf-py."""
    if loaded.dtype == torch.uint8 and param.dtype != torch.uint8:
        from llmplug.quantization.gguf import packed_type

        qtype = packed_type(loaded)
        if qtype is not None:
            import gguf

            loaded = torch.from_numpy(gguf.quants.dequantize(loaded.numpy(), qtype)).reshape(param.shape)
    default_weight_loader(param, loaded)
