"""PlainLayer: the parts of a decoder layer of the common plain shape, which the C++ stack (native_stack.py) and the
straight-line run (fast_path.py) compute as kernel calls, and the per-call conditions both check."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.layers.activation import SiluAndMul
from llmplug.layers.attention.layer import Attention
from llmplug.layers.attention.torch_sdpa import native_capable
from llmplug.layers.decoder.attention import DecoderAttention
from llmplug.layers.decoder.layer import DecoderLayer
from llmplug.layers.decoder.mlp import DecoderMLP
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.linear import LinearBase

__all__ = ["PlainLayer", "layer_allows", "plain_layer"]


@dataclass(frozen=True, slots=True)
class PlainLayer:
    """The modules of one plain layer the kernel calls read (weights and caches are read at call time)."""

    input_norm: RMSNorm
    qkv: LinearBase
    attention: DecoderAttention  # its q/k norms, if any
    attn: Attention
    o: LinearBase
    mlp_norm: RMSNorm
    gate_up: LinearBase
    down: LinearBase
    hook_dicts: tuple[dict, ...]  # every module's forward (pre-)hooks: a hook sends the layer through its modules
    rotary_heads: int  # q and k heads, rotated together

    @property
    def linears(self) -> tuple[LinearBase, ...]:
        return self.qkv, self.o, self.gate_up, self.down


def plain_layer(layer: nn.Module) -> PlainLayer | None:
    """The layer's parts if it has the plain shape the straight-line run computes, else None (a layer of another
    class, a subclass included, may compute otherwise)."""
    if type(layer) is not DecoderLayer:
        return None
    attention, mlp = getattr(layer, "self_attn", None), layer.mlp
    if (
        layer.parallel
        or layer.norm_after_residual
        or layer.post_norm
        or layer.parallel_mixer
        or layer.mixer_kind != "attention"
        or layer.residual_multiplier != 1.0
        or get_tp_group().world_size != 1
        or type(attention) is not DecoderAttention
        or type(mlp) is not DecoderMLP
        or not (_plain_norm(layer.input_layernorm) and _plain_norm(layer.post_attention_layernorm))
    ):
        return None
    assert isinstance(attention, DecoderAttention) and isinstance(mlp, DecoderMLP)  # for the type checker
    attn = attention.attn
    if (
        attention.gated
        or attention.clip_qkv is not None
        or attention.key_multiplier != 1.0
        or not native_capable(attn)
        or attn.values_in_keys is not None
        or not mlp.gated
        or type(mlp.act_fn) is not SiluAndMul
        or mlp.gate_multiplier != 1.0
        or mlp.down_multiplier != 1.0
    ):
        return None
    hook_dicts = tuple(d for m in layer.modules() for d in (m._forward_hooks, m._forward_pre_hooks))
    return PlainLayer(
        layer.input_layernorm, attention.qkv_proj, attention, attn, attention.o_proj, layer.post_attention_layernorm,
        mlp.gate_up_proj, mlp.down_proj, hook_dicts, attention.num_heads + attention.num_kv_heads,
    )


def _plain_norm(norm: object) -> bool:
    """Whether `norm` is a plain RMSNorm (one kernel call)."""
    return type(norm) is RMSNorm and norm.plain


def layer_allows(plain: PlainLayer, hidden: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """The per-call conditions: no hooks, no LoRA, a bound two-plane cache, the norm kernels' layout and dtype."""
    if any(plain.hook_dicts) or any(linear.lora is not None for linear in plain.linears):
        return False
    if hidden.dim() != 2 or hidden.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        return False
    cache, dtype = plain.attn.kv_cache, hidden.dtype
    if cache is None or cache.size(0) != 2:
        return False
    return plain.input_norm.weight.dtype == dtype and plain.mlp_norm.weight.dtype == dtype
