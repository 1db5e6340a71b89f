"""The interface an attention backend implements (the `llmplug.attention` entry-point group).

A backend is a class used through its classmethods; the model runner and the `Attention` layers
call it, never the model:

- model runner, once at start-up: `layer_kv_cache_shape(layer, ...)` (by default `kv_cache_shape` of the
  layer's heads) to allocate one cache tensor per layer, then `bind_kv_cache(model, caches, backend)`
  hands each `Attention` layer its tensor;
- model runner, once per step: `build_metadata(common)`; the result is entered with
  `with forward_context(metadata):` around `model(input_ids, positions)`;
- each `Attention` layer, once per step: `forward(layer, q, k, v, metadata)`, which writes this
  step's k/v into `layer.kv_cache` and returns the attention output. A backend may keep per-layer
  state across steps in `layer.backend_state` (reset by `bind_kv_cache`).

Optional attention features (sliding window, chunked local attention, logit soft-capping, ALiBi, sinks, bidirectional
attention of encoders; see `Attention`) are
read from the layer. A backend lists those it implements in `supported_features`; `bind_kv_cache`
refuses a layer that uses any other, so no backend silently ignores one.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from llmplug.layers.forward_context import CommonAttentionMetadata

if TYPE_CHECKING:
    from llmplug.layers.attention.layer import Attention

__all__ = ["ATTENTION_FEATURES", "AttentionBackend"]

# names of the optional features an Attention layer may use (`Attention.features`)
ATTENTION_FEATURES = frozenset(
    {"sliding_window", "chunked", "logit_softcap", "alibi", "sinks", "values_in_keys", "bidirectional"}
)


class AttentionBackend(abc.ABC):
    """Paged attention over a block-structured KV cache; stateless, used through classmethods."""

    name: ClassVar[str] = ""
    # the `Attention.features` names this backend implements; none unless a backend says so
    supported_features: ClassVar[frozenset[str]] = frozenset()
    # whether `build_metadata` honours `CommonAttentionMetadata.batch_invariant` (docs/determinism.md)
    supports_batch_invariant: ClassVar[bool] = False
    # whether `forward` honours `CommonAttentionMetadata.bidirectional_spans` (layers/attention/spans.py)
    supports_bidirectional_spans: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor holding K and V of `num_blocks` blocks."""

    @classmethod
    def layer_kv_cache_shape(cls, layer: "Attention", num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of `layer`'s cache tensor (layers may differ: a latent layer stores no values)."""
        return cls.kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)

    @classmethod
    @abc.abstractmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """This step's backend metadata (index tensors, masks), built once and shared by every layer."""

    @classmethod
    @abc.abstractmethod
    def forward(
        cls, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """Store k, v [T, Hkv * D] in `layer.kv_cache`; attend q [T, H * D] over the cache -> [T, H * D]."""

    @classmethod
    def discard_step(cls, layer: "Attention", slot_mapping: torch.Tensor) -> None:
        """After a failed step: forget what it may have left in `layer` (the model runner calls this for every
        layer). Its slots may hold garbage (NaN from a pass that failed half-way); a backend that reads slots
        past a request's keys as masked padding must clear them, since 0 * NaN is NaN. Default: nothing."""

    @classmethod
    def computes_prompt_rows_apart(cls, layer: "Attention", dtype: torch.dtype, device: torch.device,
                                   block_size: int) -> bool:
        """Whether `layer`'s prompt rows (positions before `CommonAttentionMetadata.prompt_lens`) take another kernel
        than its generated rows: then the engine names the KV blocks of generated tokens apart (kv_cache.py), so a
        later prompt holding them computes them as a prompt does. Default: no."""
        return False

    @classmethod
    def supports(cls, head_dim: int, dtype: torch.dtype) -> bool:
        """Whether this backend can run layers of `head_dim` in `dtype` (platforms ask before choosing)."""
        return True
