"""Bidirectional spans: runs of prompt tokens that attend to one another both ways (Gemma 3's images, PaliGemma's
prompt) inside an otherwise causal layer, as transformers' `block_sequence_ids` overlay does at prefill.

A query at position i of a span [s, e) sees the keys j < e with j <= i or j >= s; a sliding-window layer keeps only
those with i - j < W (Gemma 3's AND(window, OR(causal, block))). Every other query is causal as before.

The backend computes every row causally first; then, for each span (whole in the step: the scheduler never splits
one), its rows are computed again over the keys its queries reach, read back from the cache the step just wrote,
and replace the causal ones. A step without spans costs nothing more; a span costs one SDPA call per layer.
Cache layouts: TorchSDPABackend's, [2 (or 1), num_kv_heads, num_blocks, block_size, head_dim], and, `token_major`,
TritonAttentionBackend's, [2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn.functional as F

from llmplug.core.errors import ConfigError
from llmplug.layers.forward_context import BidirectionalSpan

if TYPE_CHECKING:
    from llmplug.layers.attention.backend import AttentionBackend
    from llmplug.layers.attention.layer import Attention

__all__ = ["attend_spans", "check_spans_supported"]

# layer features the span rows do not model (a causal layer with none of them, or only a window, is fine)
UNSUPPORTED = frozenset({"chunked", "logit_softcap", "alibi", "sinks"})


def check_spans_supported(model_name: str, backend: type[AttentionBackend], layers: Iterable[Attention]) -> None:
    """ConfigError when a model with bidirectional spans runs on a backend or with a layer feature they lack."""
    if not getattr(backend, "supports_bidirectional_spans", False):
        raise ConfigError(
            f"{model_name} lets prompt spans attend bidirectionally, which attention backend "
            f"{backend.name or backend.__name__!r} does not implement; use device.attention_backend 'torch_sdpa' or "
            "'triton'"
        )
    for layer in layers:
        missing = layer.features & UNSUPPORTED
        if layer.causal and missing:
            raise ConfigError(f"{model_name}: bidirectional spans are not modelled with {sorted(missing)} (Attention "
                             f"layer {layer.layer_name!r})")


def attend_spans(layer: Attention, q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor,
                 spans: tuple[BidirectionalSpan, ...], block_tables: torch.Tensor, block_size: int,
                 token_major: bool = False) -> torch.Tensor:
    """Replace the rows of `out` [T, H * Dv] of each span's queries (q [T, H * D]) by their bidirectional ones."""
    for span in spans:
        rows = slice(span.row, span.row + span.length)
        out[rows] = _span_rows(layer, q[rows], cache, block_tables[span.request], block_size, span, token_major)
    return out


def _span_rows(layer: Attention, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, block_size: int,
               span: BidirectionalSpan, token_major: bool) -> torch.Tensor:
    """One span's queries q [n, H * D] over the keys they reach (its request's block table `table`) -> [n, H * Dv]."""
    n, window, end = span.length, layer.sliding_window, span.start + span.length
    first = 0 if window is None else max(0, span.start - window + 1)  # no query of the span reaches before it
    j = torch.arange(first, end, device=q.device)
    slots = table.index_select(0, j // block_size) * block_size + j % block_size
    planes, hkv, d = cache.shape[0], layer.num_kv_heads, layer.head_dim
    if token_major:  # [planes, slots, Hkv, D] -> [planes, Hkv, L, D]
        kv = cache.view(planes, -1, hkv, d).index_select(1, slots).transpose(1, 2)
    else:
        kv = cache.view(planes, hkv, -1, d).index_select(2, slots)  # [planes, Hkv, L, D]
    k, v = kv[0], kv[-1][..., : layer.v_head_dim]
    i = span.start + torch.arange(n, device=q.device)[:, None]
    keep = (j[None, :] <= i) | (j[None, :] >= span.start)  # [n, L]
    if window is not None:
        keep &= i - j[None, :] < window
    qh = q.reshape(n, layer.num_heads, d).transpose(0, 1)  # [H, n, D]
    gqa = hkv != layer.num_heads
    rows = F.scaled_dot_product_attention(qh[None], k[None], v[None], attn_mask=keep, scale=layer.scale,
                                          enable_gqa=gqa)  # [1, H, n, Dv]
    return rows[0].transpose(0, 1).reshape(n, layer.num_heads * layer.v_head_dim)
