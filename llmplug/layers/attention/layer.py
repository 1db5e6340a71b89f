"""The Attention layer models use: dispatches to the attention backend bound by the model runner."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Mapping

import torch
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.layers.attention.backend import AttentionBackend
from llmplug.layers.forward_context import get_forward_context
from llmplug.layers.weight_utils import check_shape, frozen_parameter

__all__ = ["Attention", "opaque_attention"]


class Attention(nn.Module):
    """Paged multi-head / grouped-query attention over this layer's KV cache.

    `kv_cache` and `backend` are set by `bind_kv_cache`; the step's metadata comes from the forward
    context. q, k, v arrive after projection and rotary embedding, flattened per token, and may be
    strided views (e.g. slices of a fused qkv output).

    Optional features, each off by default (transformers' semantics; query at position i, key at j):
    - `sliding_window` W: the query sees keys i - W < j <= i;
    - `attention_chunk` C (chunked local attention): the query sees keys of its own chunk of C positions,
      floor(i / C) * C <= j <= i (with a window as well: both limits);
    - `logit_softcap` c: scores = c * tanh(scores / c), after `scale`, before masking and ALiBi;
    - `alibi_slopes` [num_heads] (float32): slope_h * (j - i) added to head h's scores;
    - `use_sinks`: a learned logit per head (the `sinks` parameter, float32) joins each softmax's
      denominator and contributes no value;
    - `causal=False` ("bidirectional", encoders): each query sees every key of its own request (with a
      `sliding_window` W, the keys |i - j| < W); the step must hold each request's whole prompt, and
      no KV cache is needed (`bind_kv_cache(model, None, backend)`);
    - `values_in_keys` Dv: no v is passed or stored: the values are the first Dv dims of each key, and
      the output has Dv dims per head (multi-head latent attention, whose one KV "head" is the latent;
      needs num_kv_heads == 1; the cache holds keys only).
    Only `sinks` is a weight; heads are this tensor-parallel rank's (`alibi_slopes` already sliced).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        use_sinks: bool = False,
        causal: bool = True,
        values_in_keys: int | None = None,
        attention_chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot be grouped over {self.num_kv_heads} KV heads")
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.layer_name = prefix
        _check_features(prefix, num_heads, sliding_window, logit_softcap, alibi_slopes, attention_chunk)
        if not causal and (logit_softcap is not None or alibi_slopes is not None or use_sinks or attention_chunk):
            raise ValueError(
                f"Attention {prefix!r}: bidirectional attention with soft-capping, ALiBi, sinks or chunks "
                "is not modelled"
            )
        self.causal = causal
        _check_values_in_keys(prefix, values_in_keys, head_dim, self.num_kv_heads)
        self.values_in_keys = values_in_keys
        self.v_head_dim = values_in_keys or head_dim  # dims of each head's output
        self.sliding_window = sliding_window
        self.attention_chunk = attention_chunk
        self.logit_softcap = logit_softcap
        # a buffer, so it follows the model to its device; not persistent: no checkpoint holds it
        slopes = None if alibi_slopes is None else alibi_slopes.detach().to(torch.float32)
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        self.sinks = None
        if use_sinks:
            self.sinks = frozen_parameter(torch.empty(num_heads, dtype=torch.float32), self._load_sinks)
        self.kv_cache: torch.Tensor | None = None  # not a buffer: owned by the model runner, not the checkpoint
        self.backend: type[AttentionBackend] | None = None
        self.backend_state: object | None = None  # the backend's per-layer scratch kept across steps

    @property
    def features(self) -> frozenset[str]:
        """The optional features this layer uses (names as in `AttentionBackend.supported_features`)."""
        used = {
            "sliding_window": self.sliding_window is not None,
            "chunked": self.attention_chunk is not None,
            "logit_softcap": self.logit_softcap is not None,
            "alibi": self.alibi_slopes is not None,
            "sinks": self.sinks is not None,
            "bidirectional": not self.causal,
            "values_in_keys": self.values_in_keys is not None,
        }
        return frozenset(name for name, on in used.items() if on)

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this tensor-parallel rank's heads of the checkpoint's sinks [total_num_heads]."""
        tp = get_tp_group()
        check_shape(torch.empty(self.num_heads * tp.world_size, device="meta"), loaded_weight, "sinks")
        param.data.copy_(loaded_weight.narrow(0, tp.rank_in_group * self.num_heads, self.num_heads))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H * D], k and v [T, Hkv * D] -> [T, H * D]; k, v are stored in the cache.

        With `values_in_keys` Dv: v is None, k [T, D] holds the values in its first Dv dims -> [T, H * Dv].
        """
        if (v is None) != (self.values_in_keys is not None):
            raise ValueError(
                f"Attention {self.layer_name!r}: pass v exactly when the values are not inside the keys "
                f"(values_in_keys={self.values_in_keys})"
            )
        if self.backend is None:
            raise RuntimeError(
                f"Attention layer {self.layer_name!r} has no backend: the model runner calls "
                "bind_kv_cache(model, caches, backend) before the first forward"
            )
        if torch.compiler.is_compiling():  # one opaque call: the traced graph splits around attention
            return torch.ops.llmplug.attention(q, k, v, self.layer_name)
        return self.backend.forward(self, q, k, v, get_forward_context().attn_metadata)

    def extra_repr(self) -> str:
        text = f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, scale={self.scale:.4g}"
        if self.sliding_window is not None:
            text += f", sliding_window={self.sliding_window}"
        if self.attention_chunk is not None:
            text += f", attention_chunk={self.attention_chunk}"
        if self.logit_softcap is not None:
            text += f", logit_softcap={self.logit_softcap}"
        if self.values_in_keys is not None:
            text += f", values_in_keys={self.values_in_keys}"
        return text + "".join(f", {name}" for name in sorted(self.features & {"alibi", "sinks", "bidirectional"}))


def _check_values_in_keys(prefix: str, values: int | None, head_dim: int, num_kv_heads: int) -> None:
    """ValueError unless `values` is None or 1..head_dim with a single KV head."""
    if values is None:
        return
    if isinstance(values, bool) or not isinstance(values, int) or not 0 < values <= head_dim or num_kv_heads != 1:
        raise ValueError(
            f"Attention {prefix!r}: values_in_keys={values!r} must be in 1..head_dim={head_dim} with one KV head "
            f"(got {num_kv_heads})"
        )


def _check_features(
    prefix: str,
    num_heads: int,
    window: int | None,
    softcap: float | None,
    slopes: torch.Tensor | None,
    chunk: int | None = None,
) -> None:
    """ValueError naming the layer and the argument when a feature's value cannot be meant."""
    for name, size in (("sliding_window", window), ("attention_chunk", chunk)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"Attention {prefix!r}: {name}={size!r} must be a positive int or None")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"Attention {prefix!r}: logit_softcap={softcap!r} must be positive or None")
    if slopes is not None and tuple(slopes.shape) != (num_heads,):
        raise ValueError(
            f"Attention {prefix!r}: alibi_slopes has shape {tuple(slopes.shape)}, expected ({num_heads},): "
            "one slope per query head of this tensor-parallel rank"
        )


# The layers a compiled forward's opaque attention calls resolve their names in: a context variable, so
# that two engines in one process (or in two threads) each reach their own model's layers.
_opaque_layers: contextvars.ContextVar[Mapping[str, Attention] | None] = contextvars.ContextVar(
    "llmplug_opaque_attention_layers", default=None
)


@contextlib.contextmanager
def opaque_attention(layers: Mapping[str, Attention]) -> Iterator[None]:
    """Let `torch.ops.llmplug.attention` find `layers` by `layer_name` while a compiled forward runs."""
    token = _opaque_layers.set(layers)
    try:
        yield
    finally:
        _opaque_layers.reset(token)


# Under torch.compile the attention call is this custom op, which the compiler does not trace into: the
# backend reads the step's metadata (Python lists, per-sequence branches) and writes the KV cache, none
# of which belongs in a graph captured once. The cache is not an argument, so the op declares no mutation;
# each layer's cache is read and written by that layer's call alone, which data flow already orders.
@torch.library.custom_op("llmplug::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    layers = _opaque_layers.get()
    if layers is None:
        raise RuntimeError("torch.ops.llmplug.attention called outside `with opaque_attention(layers):`")
    layer = layers[layer_name]
    return layer.backend.forward(layer, q, k, v, get_forward_context().attn_metadata)


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    return q.new_empty(q.shape)  # [T, H * D], as the backend returns
