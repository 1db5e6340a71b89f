"""NativeDecoderStack: a model's plain layers run by llmplug's C++ `DecoderStack`, one call a step for all of them.

The straight-line run (fast_path.py) still pays Python for each layer: its calls, views and per-layer checks cost
~60 us a layer at one decode token, beside ~100 us of kernels (a third of the default model's decode step). When
every layer is plain (no q/k norms) and each linear's method computes the step's rows with one kernel the stack
knows -- llmplug's int4 matmul (`NativeInt4`), oneDNN's packed linear or F.linear, the last two by their row plan
-- the C++ stack (native/decoder_stack.cpp) makes the same kernel calls with the same arguments in the
same order, so its outputs are the straight-line run's bit for bit. An int4 copy of rows "generated" computes a
step of generated tokens only with its int4 kernel and a prompt-only step with its dense method: each step of the
default model but the mixed ones (prompt chunks beside decodes) takes the stack. Any other step, and any layer with
hooks or LoRA, runs as before.

The stack holds the layers' tensors, one per kind of step (prompt, generated). It is checked once a step, by
identity, against what the layers hold now (each linear's method and bias, each norm weight, each bound cache): a
replaced one (weights reloaded, caches rebound) rebuilds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from llmplug.layers.attention.torch_sdpa import TorchSDPAMetadata
from llmplug.layers.forward_context import current_generated_rows
from llmplug.layers.kernels.int4_matmul import NativeInt4
from llmplug.layers.packed_linear import PrepackedLinearMethod, RowPlannedDenseMethod
from llmplug.layers.quantization import DENSE, Int4LinearMethod, LinearMethod
from llmplug.layers.rotary import RotaryCosSin

if TYPE_CHECKING:
    from llmplug.layers.decoder.fast_path import _PlainLayer

__all__ = ["NativeDecoderStack", "release_native_stacks"]


class NativeDecoderStack:
    """Runs plain layers as one C++ call when the step allows (`run` returns None when it does not)."""

    def __init__(self, plain: list[_PlainLayer], rope_of_layer: list[int | None]) -> None:
        self.plain, self.rope_of_layer = plain, rope_of_layer
        self._stacks: dict[str, tuple[tuple, torch.ScriptObject]] = {}  # kind of step -> (methods held, stack)

    @classmethod
    def for_layers(
        cls, plain: list[_PlainLayer | None], rope_of_layer: list[int | None]
    ) -> NativeDecoderStack | None:
        """A stack for these layers, or None when some layer can never take it (not plain, or q/k norms)."""
        if not plain or any(p is None or p.attention.q_norm is not None for p in plain):
            return None
        return cls(plain, rope_of_layer)  # type: ignore[arg-type]

    def release(self) -> None:
        """Drop the built stacks and the tensors they hold (the next step that can take one builds it anew)."""
        self._stacks.clear()

    def run(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ropes: list[RotaryCosSin],
        metadata: TorchSDPAMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last layer's (output, residual stream), as the straight-line run gives them; None where this step or
        some layer needs that run."""
        if hidden.dim() != 2 or hidden.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
            return None
        generated = current_generated_rows()
        rows = hidden.shape[0]
        if generated is None or generated.num_rows != rows or generated.count == 0:
            step = _PROMPT
        elif generated.count == rows:
            step = _GENERATED
        else:
            return None  # prompt and generated rows: split per linear by the straight-line run
        methods = self._current_methods(hidden, step)
        if methods is None:
            return None
        built = self._stacks.get(step)
        if built is None or len(methods) != len(built[0]) or any(a is not b for a, b in zip(methods, built[0])):
            built = self._stacks[step] = methods, self._build(methods)
        common = metadata.common
        return built[1].run(
            hidden, residual, [r.cos for r in ropes], [r.sin for r in ropes], [int(r.is_neox_style) for r in ropes],
            common.slot_mapping, common.block_tables, common.query_start_loc, common.seq_lens,
        )

    def _current_methods(self, hidden: torch.Tensor, step: str) -> tuple | None:
        """Per layer, what it holds now (each linear's method for this step and its bias, the norm weights, the
        cache), or None when a layer must take the straight-line run."""
        parts: list = []
        rows = hidden.shape[0]
        for plain in self.plain:
            if any(plain.hook_dicts):
                return None
            cache = plain.attn.kv_cache
            if cache is None or cache.size(0) != 2:
                return None
            for linear in plain.linears:
                method = None if linear.lora is not None else _step_method(linear.quant_method, step, rows)
                if method is None:
                    return None
                parts += (method, linear.bias, linear.weight if method is DENSE else None)
            weights = plain.input_norm.weight, plain.mlp_norm.weight
            if weights[0].dtype != hidden.dtype or weights[1].dtype != hidden.dtype:
                return None
            parts += (*weights, cache)
            if plain.attn.backend_state is not None:
                plain.attn.backend_state = None  # as native_attention: the kernel reads the cache's blocks in place
        return tuple(parts)

    def _build(self, methods: tuple) -> torch.ScriptObject:
        """The C++ stack over the layers' current tensors; `methods`: _current_methods' answer."""
        stack = torch.classes.llmplug_cpu.DecoderStack()
        per_layer = len(methods) // len(self.plain)
        for i, (plain, rope) in enumerate(zip(self.plain, self.rope_of_layer)):
            attention, attn = plain.attention, plain.attn
            specs = [_linear_spec(linear, methods[i * per_layer + 3 * j]) for j, linear in enumerate(plain.linears)]
            stack.add_layer(
                plain.input_norm.weight, plain.mlp_norm.weight, attn.kv_cache,
                [t for tensors, _ in specs for t in tensors],
                [_EMPTY if linear.bias is None else linear.bias for linear in plain.linears],
                [n for _, ints in specs for n in ints],
                [attention.q_size, attention.kv_size, attention.head_dim, plain.rotary_heads,
                 -1 if rope is None else rope, attn.sliding_window or 0, attn.attention_chunk or 0],
                [plain.input_norm.variance_epsilon, plain.mlp_norm.variance_epsilon, attn.scale],
            )
        return stack


def release_native_stacks(model: nn.Module) -> None:
    """Drop every built C++ stack of `model`'s decoders: they hold the layers' weights and KV caches, which sleep mode
    frees (the next step builds them anew)."""
    for module in model.modules():
        stack = getattr(getattr(module, "run_layers", None), "stack", None)
        if isinstance(stack, NativeDecoderStack):
            stack.release()


_PROMPT, _GENERATED = "prompt", "generated"  # the kinds of step a stack is built for
_EMPTY = torch.empty(0)
_INT4, _PACKED, _DENSE = 0, 1, 2  # decoder_stack.cpp's LinearKind


def _step_method(method: LinearMethod, step: str, rows: int) -> LinearMethod | None:
    """The method that computes this step's `rows` rows of a linear whose method is `method`, if the stack knows it."""
    if type(method) is Int4LinearMethod:
        if method.rows == "all" or (method.rows == "generated" and step == _GENERATED):
            return method if type(method.packed) is NativeInt4 else None
        if method.rows == "generated" or (method.rows == "small" and rows > method.max_tokens):
            return _step_method(method.dense, step, rows)  # its dense method for every row
        return None
    if method is DENSE:
        return method
    if type(method) in (PrepackedLinearMethod, RowPlannedDenseMethod):
        return method
    return None


def _linear_spec(linear: nn.Module, method: LinearMethod) -> tuple[list[torch.Tensor], list[int]]:
    """A linear's three weight tensors and (kind, group size, min_rows, tile) for DecoderStack.add_layer."""
    if type(method) is Int4LinearMethod:
        packed = method.packed
        return [packed.qweight, packed.scales, packed.zeros], [_INT4, packed.group_size, 0, 0]
    plan = None if method is DENSE else method.row_plan
    plan_ints = [0, 0] if plan is None else [plan.min_rows, plan.tile or 0]
    if type(method) is PrepackedLinearMethod:
        return [method.packed, _EMPTY, _EMPTY], [_PACKED, 0, *plan_ints]
    weight = linear.weight if method is DENSE else method.weight
    return [weight, _EMPTY, _EMPTY], [_DENSE, 0, *plan_ints]
