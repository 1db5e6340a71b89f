"""The decoder's layers on the CPU: a plain pre-norm layer run as straight-line kernel calls.

For one stream the modules' Python costs as much as their kernels: module calls and the per-call checks of
each block (device, dtype, layout, LoRA, tensor parallelism) took ~70 us a layer around ~20 us of norm,
rotary, attention and activation kernels (one int4 stream: 2 ms of a 6 ms forward). A layer of the common
shape -- RMSNorm before attention and before a gated SiLU MLP, q/k/v attention (optional rotary and q/k
norms) on llmplug's paged-attention kernel, one rank, no multipliers -- runs here as the calls its modules
would make, with the same arguments in the same order, so its outputs are theirs bit for bit.

The checks are made once each at the level where they can change: the layer's shape when the path is built,
the step's (llmplug's CPU kernels in use, the activations' dtype, the torch_sdpa metadata, no global hooks)
once a forward, and per layer what can change after loading (a module hook such as EAGLE's capture, LoRA
slots, an unbound cache). A layer that fails them runs its modules. Where every layer's linears compute the step with
kernels the C++ stack knows (int4, oneDNN packed, F.linear), the run is one C++ call instead (decoder/native_stack.py),
with the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from llmplug.layers.attention.torch_sdpa import TorchSDPAMetadata, native_attention
from llmplug.layers.decoder.native_stack import NativeDecoderStack
from llmplug.layers.decoder.plain_layer import PlainLayer, layer_allows, plain_layer
from llmplug.layers.forward_context import get_forward_context
from llmplug.layers.kernels.amx_linear import amx_linear_rotary, amx_linear_silu_and_mul
from llmplug.layers.kernels.native import ops, use_native
from llmplug.layers.linear import LinearBase
from llmplug.layers.packed_linear import AmxLinearMethod
from llmplug.layers.rotary import RotaryCosSin

__all__ = ["DecoderFastPath", "LayerRows"]


class LayerRows(NamedTuple):
    """Rows added to the residual stream after the first layers (Qwen3-VL's deepstack): values[i] [R, hidden] at
    the step's token rows `rows` [R] after layer i, for i < len(values)."""

    rows: torch.Tensor
    values: torch.Tensor  # [layers, R, hidden]


class DecoderFastPath:
    """Runs a model's layers: plain ones as kernel calls when the step allows, the others as modules."""

    def __init__(self, layers: list[nn.Module], rope_of_layer: list[int | None]) -> None:
        self.layers, self.rope_of_layer = layers, rope_of_layer
        self.plain = [plain_layer(layer) for layer in layers]
        self.stack = NativeDecoderStack.for_layers(self.plain, rope_of_layer)  # all layers in one C++ call

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: list[RotaryCosSin],
        query_scale: torch.Tensor | None,
        added: LayerRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layers' (output, residual stream) for the first layer's input, as `DecoderLayer.forward` chains, with
        `added`'s rows added to the stream after their layers (counted from this stage's first)."""
        metadata = self._step_metadata(hidden, ropes, query_scale)
        if metadata is not None and added is None and self.stack is not None:
            stacked = self.stack.run(hidden, residual, ropes, metadata)
            if stacked is not None:
                return stacked
        for i, (layer, plain, rope_index) in enumerate(zip(self.layers, self.plain, self.rope_of_layer)):
            rope = None if rope_index is None else ropes[rope_index]
            if metadata is not None and plain is not None and layer_allows(plain, hidden, residual):
                hidden, residual = _run(plain, hidden, residual, rope, metadata)
            else:
                hidden, residual = layer(hidden, residual, rope, query_scale)
            if added is not None and i < len(added.values):  # the stream is hidden + residual: add to hidden
                hidden = hidden.index_add(0, added.rows, added.values[i].to(hidden.dtype))
        return hidden, residual

    def _step_metadata(
        self, hidden: torch.Tensor, ropes: list[RotaryCosSin], query_scale: torch.Tensor | None
    ) -> TorchSDPAMetadata | None:
        """The step's attention metadata if this step may take the straight-line path at all (then each layer
        is checked), else None."""
        if not use_native(hidden) or not any(self.plain) or query_scale is not None:
            return None
        if torch.compiler.is_compiling():  # a compiled forward takes the modules: its attention is an opaque op
            return None
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return None
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, TorchSDPAMetadata) or any(type(rope) is not RotaryCosSin for rope in ropes):
            return None
        return metadata


def _linear(layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` on one rank without LoRA: its method's product."""
    return layer.quant_method.apply(layer, x, layer.bias)


def _run(
    plain: PlainLayer,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    rope: RotaryCosSin | None,
    metadata: TorchSDPAMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`DecoderLayer.forward` of a plain layer, as the kernel calls its modules make."""
    kernels, norm, attention = ops(), plain.input_norm, plain.attention
    if residual is None:  # the first layer: hidden is the stream itself
        x, residual = kernels.rms_norm(hidden, norm.weight, norm.variance_epsilon), hidden
    else:  # the kernel writes hidden + residual into hidden: the new stream
        x, residual = kernels.fused_add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon), hidden
    q_end, k_end = attention.q_size, attention.q_size + attention.kv_size
    qkv = _qkv_rotated(plain, x, rope, k_end)
    if qkv is None:
        qkv = _linear(plain.qkv, x)
        qk = qkv[:, :k_end].view(qkv.shape[0], plain.rotary_heads, attention.head_dim)
        if not attention.qk_norm_after_rope:
            attention._norm_qk_(qk)
        if rope is not None:
            kernels.rotary_embedding(qk, rope.cos, rope.sin, rope.is_neox_style)
        if attention.qk_norm_after_rope:
            attention._norm_qk_(qk)
    attn = plain.attn
    hidden = _linear(
        plain.o, native_attention(attn, qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:], attn.kv_cache, metadata)
    )
    norm = plain.mlp_norm
    x, residual = kernels.fused_add_rms_norm(hidden, residual, norm.weight, norm.variance_epsilon), hidden
    return _linear(plain.down, _silu_and_mul_of(plain.gate_up, x)), residual


def _qkv_rotated(plain: PlainLayer, x: torch.Tensor, rope: RotaryCosSin | None, k_end: int) -> torch.Tensor | None:
    """qkv(x) with its q and k heads (the first k_end outputs) rotated as the product stores them: one call where qkv
    computes with the AMX kernel, the layer has no q/k norms and the rotary is rotate-half over whole heads of a
    multiple of 32 dims (the bits of the product, then rotary_embedding); None elsewhere."""
    method, head_dim = plain.qkv.quant_method, plain.attention.head_dim
    if (type(method) is not AmxLinearMethod or rope is None or not rope.is_neox_style or head_dim % 32
            or rope.cos.shape[-1] != head_dim or plain.attention.q_norm is not None):
        return None
    return amx_linear_rotary(x, method.packed, plain.qkv.bias, method.weight.shape[0], rope.cos, rope.sin, k_end,
                             head_dim)


def _silu_and_mul_of(gate_up: LinearBase, x: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul(gate_up(x))`: one call where gate_up computes with the AMX kernel and its gate and up halves are
    whole tiles (the same bits, without the [T, 2 d] product in memory between the two), else the two."""
    method = gate_up.quant_method
    if type(method) is AmxLinearMethod and method.weight.shape[0] % 32 == 0:
        return amx_linear_silu_and_mul(x, method.packed, gate_up.bias, method.weight.shape[0])
    return ops().silu_and_mul(_linear(gate_up, x))
