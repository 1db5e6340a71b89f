"""NativeDecoderStack: a model's plain layers run by llmplug's C++ `DecoderStack`, one call a step for all of them.

The straight-line run (fast_path.py) still pays Python for each layer: its calls, views and per-layer checks cost
~60 us a layer at one decode token, beside ~100 us of kernels (a third of the default model's decode step). When
every layer is plain (no q/k norms) and each linear's method computes the step's rows with one kernel the stack
knows -- llmplug's int4 matmuls (`NativeInt4`, `W4A8`), its AMX matmul, oneDNN's packed linear or F.linear, the last
two by their row plan -- the C++ stack (native/decoder_stack.cpp) makes the same kernel calls with the same arguments
in the same order, so its outputs are the straight-line run's bit for bit. An int4 copy of rows "generated" computes a
step of generated tokens only with its int4 kernel and a prompt-only step with its dense method: each step of the
default model but the mixed ones (prompt chunks beside decodes) takes the stack. Any other step, and any layer with
hooks or LoRA, runs as before.

The stack holds the layers' tensors, one per kind of step (prompt, generated). Each step checks, by identity, the
values it was built from where the layers hold them (each linear's method, bias and LoRA slots, a dense linear's
weight, each norm weight, each bound cache) and the layers' hooks: a replaced value (weights reloaded,
caches rebound) sends the step through the full per-layer checks, then rebuilds the stack.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import nn

from llmplug.layers.attention.torch_sdpa import TorchSDPAMetadata
from llmplug.layers.decoder.plain_layer import PlainLayer, layer_allows
from llmplug.layers.forward_context import current_generated_rows
from llmplug.layers.kernels.int4_matmul import NativeInt4
from llmplug.layers.kernels.w4a8 import W4A8
from llmplug.layers.packed_linear import AmxLinearMethod, PrepackedLinearMethod, RowPlannedDenseMethod
from llmplug.layers.quantization import DENSE, Int4LinearMethod, LinearMethod
from llmplug.layers.rotary import RotaryCosSin

__all__ = ["NativeDecoderStack", "release_native_stacks"]


class NativeDecoderStack:
    """Runs plain layers as one C++ call when the step allows (`run` returns None when it does not)."""

    def __init__(self, plain: list[PlainLayer], rope_of_layer: list[int | None]) -> None:
        self.plain, self.rope_of_layer = plain, rope_of_layer
        self._hook_dicts = tuple(d for p in plain for d in p.hook_dicts)  # any hook: the straight-line run
        self._stacks: dict[str, _Built] = {}  # kind of step -> its stack

    @classmethod
    def for_layers(
        cls, plain: list[PlainLayer | None], rope_of_layer: list[int | None]
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
        if any(self._hook_dicts):
            return None
        built = self._stacks.get(step)
        if built is None or not built.holds(hidden):
            methods = self._step_methods(hidden, residual, step)
            if methods is None:
                return None
            if built is None or not built.holds(hidden):  # else only an attention state was dropped
                built = self._stacks[step] = self._build(methods, hidden)
        common = metadata.common
        return built.stack.run(
            hidden, residual, [r.cos for r in ropes], [r.sin for r in ropes], [int(r.is_neox_style) for r in ropes],
            common.slot_mapping, common.block_tables, common.query_start_loc, common.seq_lens, common.prompt_lens,
        )

    def _step_methods(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, step: str
    ) -> list[tuple[LinearMethod, ...]] | None:
        """Per layer, the method that computes each linear's rows of this step; None when some layer must take the
        straight-line run (`layer_allows` says no, or the stack does not know a method)."""
        per_layer = []
        for plain in self.plain:
            if not layer_allows(plain, hidden, residual):
                return None
            methods = tuple(_step_method(linear.quant_method, step, hidden.shape[0]) for linear in plain.linears)
            if any(method is None for method in methods):
                return None
            if plain.attn.backend_state is not None:
                plain.attn.backend_state = None  # as native_attention: the kernel reads the cache's blocks in place
            per_layer.append(methods)
        return per_layer

    def _build(self, methods: list[tuple[LinearMethod, ...]], hidden: torch.Tensor) -> _Built:
        """The C++ stack over the layers' current tensors, each linear computed by its method in `methods`."""
        stack = torch.classes.llmplug_cpu.DecoderStack()
        watched: list[tuple[dict, str]] = []
        for plain, rope, layer_methods in zip(self.plain, self.rope_of_layer, methods):
            attention, attn = plain.attention, plain.attn
            specs = [_linear_spec(linear, method) for linear, method in zip(plain.linears, layer_methods)]
            stack.add_layer(
                plain.input_norm.weight, plain.mlp_norm.weight, attn.kv_cache,
                [t for tensors, _ in specs for t in tensors],
                [_EMPTY if linear.bias is None else linear.bias for linear in plain.linears],
                [n for _, ints in specs for n in ints],
                [attention.q_size, attention.kv_size, attention.head_dim, plain.rotary_heads,
                 -1 if rope is None else rope, attn.sliding_window or 0, attn.attention_chunk or 0],
                [plain.input_norm.variance_epsilon, plain.mlp_norm.variance_epsilon, attn.scale],
            )
            watched += _watched(plain, layer_methods)
        min_rows = max((_min_rows(linear.quant_method) for plain in self.plain for linear in plain.linears), default=0)
        return _Built(stack, hidden.dtype, min_rows, tuple(watched), tuple(_read(watched)))


class _Built(NamedTuple):
    """A built C++ stack and what it was built from."""

    stack: torch.ScriptObject
    dtype: torch.dtype  # the activations' (and the norm weights')
    min_rows: int  # below it some linear computes its rows with another method
    watched: tuple[tuple[dict, str], ...]  # where the layers hold each value the stack was built from
    values: tuple  # those values then

    def holds(self, hidden: torch.Tensor) -> bool:
        """Whether the stack computes this step as the layers would (their values are the ones it was built from)."""
        if hidden.dtype != self.dtype or hidden.shape[0] < self.min_rows:
            return False
        return all(map(operator.is_, _read(self.watched), self.values))


def release_native_stacks(model: nn.Module) -> None:
    """Drop every built C++ stack of `model`'s decoders: they hold the layers' weights and KV caches, which sleep mode
    frees (the next step builds them anew)."""
    for module in model.modules():
        stack = getattr(getattr(module, "run_layers", None), "stack", None)
        if isinstance(stack, NativeDecoderStack):
            stack.release()


_PROMPT, _GENERATED = "prompt", "generated"  # the kinds of step a stack is built for
_EMPTY = torch.empty(0)
_MISSING = object()  # a watched value no longer where it was
_INT4, _PACKED, _DENSE, _AMX, _W4A8 = 0, 1, 2, 3, 4  # decoder_stack.cpp's LinearKind


def _step_method(method: LinearMethod, step: str, rows: int) -> LinearMethod | None:
    """The method that computes this step's `rows` rows of a linear whose method is `method`, if the stack knows it."""
    if type(method) is Int4LinearMethod:
        if method.rows == "all" or (method.rows == "generated" and step == _GENERATED):
            return method if type(method.packed) in (NativeInt4, W4A8) else None
        if method.rows == "generated" or (method.rows == "small" and rows > method.max_tokens):
            return _step_method(method.dense, step, rows)  # its dense method for every row
        return None
    if method is DENSE:
        return method
    if type(method) in (PrepackedLinearMethod, RowPlannedDenseMethod, AmxLinearMethod):
        return method
    return None


def _linear_spec(linear: nn.Module, method: LinearMethod) -> tuple[list[torch.Tensor], list[int]]:
    """A linear's three weight tensors and (kind, group size, min_rows, tile) for DecoderStack.add_layer."""
    if type(method) is Int4LinearMethod:
        packed = method.packed
        if type(packed) is W4A8:
            return [packed.packed, _EMPTY, _EMPTY], [_W4A8, packed.out_features, 0, 0]
        return [packed.qweight, packed.scales, packed.zeros], [_INT4, packed.group_size, 0, 0]
    if type(method) is AmxLinearMethod:
        return [method.packed, _EMPTY, _EMPTY], [_AMX, method.weight.shape[0], 0, 0]
    plan = None if method is DENSE else method.row_plan
    plan_ints = [0, 0] if plan is None else [plan.min_rows, plan.tile or 0]
    if type(method) is PrepackedLinearMethod:
        return [method.packed, _EMPTY, _EMPTY], [_PACKED, 0, *plan_ints]
    weight = linear.weight if method is DENSE else method.weight
    return [weight, _EMPTY, _EMPTY], [_DENSE, 0, *plan_ints]


def _watched(plain: PlainLayer, methods: tuple[LinearMethod, ...]) -> list[tuple[dict, str]]:
    """Where the layer holds each value its part of a stack is built from (the dict and the key); `methods`: its
    linears' for the step. A method is replaced, not changed in place, so its identity stands for its tensors."""
    spots = [_spot(plain.input_norm, "weight"), _spot(plain.mlp_norm, "weight")]
    spots += [_spot(plain.attn, "kv_cache"), _spot(plain.attn, "backend_state")]
    for linear, method in zip(plain.linears, methods):
        spots += [_spot(linear, name) for name in ("quant_method", "bias", "lora")]
        if method is DENSE:  # F.linear of the linear's own weight
            spots.append(_spot(linear, "weight"))
    return spots


def _spot(module: nn.Module, name: str) -> tuple[dict, str]:
    """The dict holding `module`'s attribute `name`: its parameters, buffers, submodules or instance dict."""
    for held in (module._parameters, module._buffers, module._modules):
        if name in held:
            return held, name
    return vars(module), name


def _read(watched: list[tuple[dict, str]] | tuple[tuple[dict, str], ...]) -> list:
    """The watched values now."""
    return [held.get(name, _MISSING) for held, name in watched]


def _min_rows(method: LinearMethod) -> int:
    """The fewest rows a stack built with `method` computes: an int4 method of rows "small" computes up to
    `max_tokens` rows with its kernel, which the stack takes only where it computes every row."""
    if type(method) is Int4LinearMethod and method.rows == "small":
        return method.max_tokens + 1
    return 0
