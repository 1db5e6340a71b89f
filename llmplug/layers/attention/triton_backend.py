"""TritonAttentionBackend: paged attention with llmplug's Triton kernels, the default on CUDA and ROCm.

Per layer and step: one `reshape_and_cache` launch stores the step's keys and values at their slots,
then one `paged_attention` launch attends every query of the step (prompts, chunked-prefill chunks,
prefix-cache hits and decodes alike) over the cache through the block tables. The metadata is the
runner's flattened batch as it already sits on the device: nothing is built on the host, copied or
synchronised per step or per layer.

Cache layout: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim], so that one token's keys
of all KV heads are one contiguous row of a cache slot.

The layer's attention features (sliding window, chunk, logit soft-cap, ALiBi slopes, sinks) are read from
the layer and passed to the kernel; all of them are supported. A step with bidirectional spans (a model's
`bidirectional_spans`) recomputes their queries' rows after the kernel (spans.py); a step without costs nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmplug.layers.attention.backend import AttentionBackend
from llmplug.layers.attention.spans import attend_spans
from llmplug.layers.forward_context import BidirectionalSpan, CommonAttentionMetadata
from llmplug.layers.kernels.paged_attention import paged_attention
from llmplug.layers.kernels.reshape_and_cache import reshape_and_cache

if TYPE_CHECKING:
    from llmplug.layers.attention.layer import Attention

__all__ = ["TritonAttentionBackend", "TritonAttentionMetadata"]


@dataclass(slots=True, frozen=True)
class TritonAttentionMetadata:
    """The step's device tensors the kernels read, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot of each token
    query_start_loc: torch.Tensor  # [B + 1] cumulative query counts
    seq_lens: torch.Tensor  # [B] keys of each request after this step
    block_tables: torch.Tensor  # [B, max_blocks]
    max_query_len: int  # host int: chooses the kernel's program shape
    block_size: int
    bidirectional_spans: tuple[BidirectionalSpan, ...] = ()  # prompt spans attending both ways (spans.py)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in two Triton launches per layer; on a CPU only under TRITON_INTERPRET=1 (tests)."""

    name = "triton"
    supported_features = frozenset({"sliding_window", "chunked", "logit_softcap", "alibi", "sinks"})
    supports_bidirectional_spans = True

    @classmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """The runner's tensors as they are: the kernels find each program's request themselves."""
        return TritonAttentionMetadata(
            common.slot_mapping, common.query_start_loc, common.seq_lens, common.block_tables, common.max_query_len,
            common.block_size, common.bidirectional_spans,
        )

    @classmethod
    def forward(
        cls, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: TritonAttentionMetadata
    ) -> torch.Tensor:
        """Write k, v [T, Hkv * D] into the layer's cache, attend q [T, H * D] -> [T, H * D]."""
        cache = layer.kv_cache
        if cache is None:
            raise RuntimeError(
                f"the triton attention backend reads keys from the KV cache, and layer {layer.layer_name!r} has "
                "none: call bind_kv_cache(model, caches, backend) with a cache first"
            )
        reshape_and_cache(k, v, cache[0], cache[1], metadata.slot_mapping)
        num_tokens, heads, head_dim = q.shape[0], layer.num_heads, layer.head_dim
        out = q.new_empty(num_tokens, heads * head_dim)
        paged_attention(
            out.view(num_tokens, heads, head_dim),
            q.view(num_tokens, heads, head_dim),
            cache[0],
            cache[1],
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            max_query_len=metadata.max_query_len,
            scale=layer.scale,
            **_features(layer, q.device),
        )
        if metadata.bidirectional_spans:  # only for a model that declares them
            attend_spans(layer, q, out, cache, metadata.bidirectional_spans, metadata.block_tables,
                         metadata.block_size, token_major=True)
        return out


def _features(layer: "Attention", device: torch.device) -> dict:
    """The layer's attention features as the kernel's keyword arguments (absent ones are None)."""
    slopes, sinks = layer.alibi_slopes, layer.sinks
    return dict(
        sliding_window=layer.sliding_window,
        attention_chunk=layer.attention_chunk,
        logit_softcap=layer.logit_softcap,
        alibi_slopes=None if slopes is None else slopes.to(device, torch.float32),
        sinks=None if sinks is None else sinks.to(device, torch.float32),
    )
