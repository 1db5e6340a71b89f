"""NativeDecoderStack: a model's plain layers run by llmplug's C++ `DecoderStack`, one call a step for all of them.

The straight-line run (fast_path.py) still pays Python for each layer: its calls, views and per-layer checks cost
~60 us a layer at one decode token, beside ~100 us of kernels (a third of the default model's decode step). When
every layer is plain and every linear is an int4 copy the step computes in int4 (`NativeInt4` with rows "all", or
"generated" in a step whose rows are all generated tokens: every decode step of the default model), the C++ stack
(native/decoder_stack.cpp) makes the same kernel calls with the same arguments in the same order, so its outputs
are the straight-line run's bit for bit. Any other step, and any layer with hooks or LoRA, runs as before.

The stack holds the layers' tensors. It is checked once a step, by identity, against what the layers hold now
(each linear's quant method and bias, each norm weight, each bound cache): a replaced one (weights reloaded, caches
rebound) rebuilds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmplug.layers.attention.torch_sdpa import TorchSDPAMetadata
from llmplug.layers.forward_context import current_generated_rows
from llmplug.layers.kernels.int4_matmul import NativeInt4
from llmplug.layers.quantization import Int4LinearMethod
from llmplug.layers.rotary import RotaryCosSin

if TYPE_CHECKING:
    from llmplug.layers.decoder.fast_path import _PlainLayer

__all__ = ["NativeDecoderStack"]

_STACK_ROWS = ("all", "generated")  # the Int4LinearMethod rows a stack can take (both row invariant)


class NativeDecoderStack:
    """Runs plain layers as one C++ call when the step allows (`run` returns None when it does not)."""

    def __init__(self, plain: list[_PlainLayer], rope_of_layer: list[int | None]) -> None:
        self.plain, self.rope_of_layer = plain, rope_of_layer
        self._parts: tuple = ()
        self._stack: torch.ScriptObject | None = None

    @classmethod
    def for_layers(
        cls, plain: list[_PlainLayer | None], rope_of_layer: list[int | None]
    ) -> NativeDecoderStack | None:
        """A stack for these layers, or None when some layer can never take it (not plain, or q/k norms)."""
        if not plain or any(p is None or p.attention.q_norm is not None for p in plain):
            return None
        return cls(plain, rope_of_layer)  # type: ignore[arg-type]

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
        parts = self._current_parts(hidden)
        if parts is None:
            return None
        if len(parts) != len(self._parts) or any(a is not b for a, b in zip(parts, self._parts)):
            self._stack, self._parts = self._build(), parts
        common = metadata.common
        return self._stack.run(
            hidden, residual, [r.cos for r in ropes], [r.sin for r in ropes], [int(r.is_neox_style) for r in ropes],
            common.slot_mapping, common.block_tables, common.query_start_loc, common.seq_lens,
        )

    def _current_parts(self, hidden: torch.Tensor) -> tuple | None:
        """What each layer holds now (by identity), or None when a layer must take the straight-line run."""
        generated = current_generated_rows()
        rows = hidden.shape[0]
        all_generated = generated is not None and generated.num_rows == rows and generated.count == rows
        parts: list = []
        for plain in self.plain:
            if any(plain.hook_dicts):
                return None
            cache = plain.attn.kv_cache
            if cache is None or cache.size(0) != 2:
                return None
            for linear in plain.linears:
                method = linear.quant_method
                if (
                    linear.lora is not None
                    or type(method) is not Int4LinearMethod
                    or type(method.packed) is not NativeInt4
                    or method.rows not in _STACK_ROWS
                    or (method.rows == "generated" and not all_generated)
                ):
                    return None
                parts += (method, linear.bias)
            weights = plain.input_norm.weight, plain.mlp_norm.weight
            if weights[0].dtype != hidden.dtype or weights[1].dtype != hidden.dtype:
                return None
            parts += (*weights, cache)
            if plain.attn.backend_state is not None:
                plain.attn.backend_state = None  # as native_attention: the kernel reads the cache's blocks in place
        return tuple(parts)

    def _build(self) -> torch.ScriptObject:
        """The C++ stack over the layers' current tensors."""
        stack = torch.classes.llmplug_cpu.DecoderStack()
        empty = torch.empty(0)
        for plain, rope in zip(self.plain, self.rope_of_layer):
            attention, attn = plain.attention, plain.attn
            packed = [linear.quant_method.packed for linear in plain.linears]
            stack.add_layer(
                plain.input_norm.weight, plain.mlp_norm.weight, attn.kv_cache,
                [t for p in packed for t in (p.qweight, p.scales, p.zeros)],
                [empty if linear.bias is None else linear.bias for linear in plain.linears],
                [p.group_size for p in packed],
                [attention.q_size, attention.kv_size, attention.head_dim, plain.rotary_heads,
                 -1 if rope is None else rope, attn.sliding_window or 0, attn.attention_chunk or 0],
                [plain.input_norm.variance_epsilon, plain.mlp_norm.variance_epsilon, attn.scale],
            )
        return stack
