"""Tiny quantized Llama checkpoints for the method tests, and the dense reference transformers computes with.

A tiny transformers Llama is saved, then its linear layers' weights are replaced by a format's tensors (made by
the format's own tool where installable, else by a packer the test documents), and the transformers model gets
the weights those tensors decode to (by the format's own dequantizer, or the test's, never llmplug's): its
logits and greedy tokens are the truth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from llmplug.testing.tiny import TinyCheckpoint, save_tiny_checkpoint, tiny_config

# a quantizer: (name, dense [N, K] float32 weight) -> (checkpoint tensors replacing `name.weight`, decoded [N, K])
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# every linear's K and N a multiple of 128 (groups of 128, the kernel's 16 outputs, packs of 8)
SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def tiny_llama(path: Path, seed: int = 0, **sizes: Any) -> TinyCheckpoint:
    """A tiny float32 Llama checkpoint with SIZES (or `sizes`) and its transformers model."""
    return save_tiny_checkpoint(tiny_config(LlamaConfig, **{**SIZES, **sizes}), path, seed=seed)


def quantize_checkpoint(
    checkpoint: TinyCheckpoint, quantize: Quantizer, quantization_config: dict[str, Any],
    skip: tuple[str, ...] = (),
) -> None:
    """Replace each linear weight of the checkpoint (but those whose name contains a `skip` entry) by `quantize`'s
    tensors, write `quantization_config` into config.json, and give the transformers model the decoded weights."""
    file = checkpoint.path / "model.safetensors"
    tensors = load_file(file)
    params = dict(checkpoint.hf_model.named_parameters())
    for name in [n for n in tensors if n.rsplit(".", 2)[-2] in LINEARS]:
        module = name.removesuffix(".weight")
        if any(s in module for s in skip):
            continue
        replacement, decoded = quantize(module, tensors.pop(name).float())
        tensors.update(replacement)
        with torch.no_grad():
            params[name].copy_(decoded)
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = checkpoint.path / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(config | {"quantization_config": quantization_config}, indent=2))


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers and of what its layers' methods hold (packed weights, scales)."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        compute = getattr(getattr(module, "quant_method", None), "compute", None)
        packed = getattr(compute, "packed", None)
        tensors += [packed.weight, packed.scales_and_zeros] if packed is not None else []
        weight_t = getattr(getattr(module, "quant_method", None), "weight_t", None)
        tensors += [weight_t] if weight_t is not None else []
    return sum(t.numel() * t.element_size() for t in tensors)


def rtn_groups(weight: torch.Tensor, bits: int, group_size: int, sym: bool, zero_range: tuple[int, int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest groupwise quantization, the textbook way: (q [N, K], scale [N, G] float16, zero [N, G]),
    w ~ (q - zero) * scale; group_size -1: one group per row. `zero_range` clamps asymmetric zeros."""
    n, k = weight.shape
    size = k if group_size == -1 else group_size
    groups = weight.reshape(n, k // size, size)
    maxq = 2**bits - 1
    if sym:
        scale = (groups.abs().amax(-1) * 2 / maxq).clamp(min=1e-6).half()
        zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int32)
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = ((high - low) / maxq).clamp(min=1e-6).half()
        zero = (-low / scale.float()).round().to(torch.int32).clamp(*(zero_range or (0, maxq)))
    q = (groups / scale.float().unsqueeze(-1) + zero.unsqueeze(-1)).round().clamp(0, maxq).to(torch.int32)
    return q.reshape(n, k), scale, zero
