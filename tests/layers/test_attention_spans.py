"""Bidirectional spans (layers/attention/spans.py) on every CPU path — torch_sdpa's kernel and torch paths, and the
triton backend under triton's interpreter — against a dense reference mask: a query of a span [s, e) sees the keys
j < e with j <= i or j >= s (within the window: i - j < W), every other query is causal, over a cached context."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.attention.triton_backend import TritonAttentionBackend
from llmplug.layers.forward_context import BidirectionalSpan, forward_context
from llmplug.layers.kernels.native import KERNELS_ENV
from tests.layers.test_triton_backend import D, common_metadata, make_layer

HEADS, KV_HEADS, BLOCK = 4, 2, 4
# (cached context, new tokens, spans of the new step as (start, end) positions)
REQUESTS = [(5, 12, [(7, 13)]), (0, 9, [(0, 3), (4, 9)]), (0, 6, [])]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: list[tuple[int, int]],
              window: int | None) -> torch.Tensor:
    """Dense attention of every position of one request: q [n, H * D], k, v [n, Hkv * D] -> [n, H * D]."""
    n = q.shape[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = j <= i
    for s, e in spans:
        keep |= (i >= s) & (i < e) & (j >= s) & (j < e)
    if window is not None:
        keep &= i - j < window
    qh = q.view(n, HEADS, D).transpose(0, 1)[None]
    kh, vh = (x.view(n, KV_HEADS, D).transpose(0, 1)[None] for x in (k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, scale=D**-0.5, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, HEADS * D)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("path", ["kernel", "torch", "triton"])
def test_span_queries_see_their_whole_span_and_the_rest_is_causal(path, window, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "0" if path == "torch" else "auto")
    backend = TritonAttentionBackend if path == "triton" else TorchSDPABackend
    layer = make_layer(backend, HEADS, KV_HEADS, BLOCK)
    layer.sliding_window = window
    gen = torch.Generator().manual_seed(0)
    totals = [c + n for c, n, _ in REQUESTS]
    qkv = [[torch.randn(t, w * D, generator=gen) for w in (HEADS, KV_HEADS, KV_HEADS)] for t in totals]
    tables = [list(range(10 * r, 10 * r + -(-t // BLOCK))) for r, t in enumerate(totals)]
    cached = [(r, c) for r, (c, _, _) in enumerate(REQUESTS) if c]
    with forward_context(backend.build_metadata(common_metadata([(0, c) for _, c in cached],
                                                                [tables[r] for r, _ in cached], BLOCK))):
        layer(*(torch.cat([qkv[r][x][:c] for r, c in cached]) for x in range(3)))  # the context, causal
    common = common_metadata([(c, c + n) for c, n, _ in REQUESTS], tables, BLOCK)
    starts = [0, *torch.tensor([n for _, n, _ in REQUESTS]).cumsum(0).tolist()]
    spans = tuple(BidirectionalSpan(r, starts[r] + s - c, s, e - s)
                  for r, (c, _, request_spans) in enumerate(REQUESTS) for s, e in request_spans)
    with forward_context(backend.build_metadata(dataclasses.replace(common, bidirectional_spans=spans))):
        out = layer(*(torch.cat([qkv[r][x][c:] for r, (c, _, _) in enumerate(REQUESTS)]) for x in range(3)))
    for r, (c, n, request_spans) in enumerate(REQUESTS):
        expected = reference(*qkv[r], request_spans, window)[c:]
        torch.testing.assert_close(out[starts[r] : starts[r + 1]], expected, rtol=0, atol=1e-5)
