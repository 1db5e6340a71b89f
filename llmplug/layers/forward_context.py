"""Per-step state that layers read during `model.forward`, entered with `with forward_context(...)`."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch


@dataclass(slots=True, frozen=True)
class BidirectionalSpan:
    """A run of one request's prompt tokens, all in this step, that attend to one another both ways (an image of
    Gemma 3, PaliGemma's prompt); the rest of attention stays causal (layers/attention/spans.py)."""

    request: int  # its request's index in the step
    row: int  # its first token's row in the step's T tokens
    start: int  # its first token's index in the request's sequence
    length: int


@dataclass(slots=True, frozen=True)
class CommonAttentionMetadata:
    """The flattened batch of one step, as the model runner builds it (backend independent).

    B requests, T = sum of their scheduled tokens, laid out request after request.
    """

    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative scheduled tokens
    seq_lens: torch.Tensor  # [B] int64, KV length of each request after this step
    num_computed_tokens: torch.Tensor  # [B] int64, KV already cached before this step
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 (masked by seq_lens)
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) of each token
    positions: torch.Tensor  # [T] int64
    block_size: int
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    # Python-side copies, so backends can choose a path without a device sync.
    query_lens_list: tuple[int, ...] = ()
    seq_lens_list: tuple[int, ...] = ()
    # ModelConfig.batch_invariant: every query row reduces over its keys in one fixed order (docs/determinism.md)
    batch_invariant: bool = False
    # spans of prompt tokens attending bidirectionally, for a model that declares `bidirectional_spans`; else empty
    bidirectional_spans: tuple[BidirectionalSpan, ...] = ()
    # [B] int64, each request's prompt length (positions before it are prompt tokens: the CPU attention computes
    # those rows with its prompt kernel, docs/kernels.md); None: every row as a generated one
    prompt_lens: torch.Tensor | None = None


@dataclass(slots=True, frozen=True)
class GeneratedRows:
    """Which rows of a call are generated tokens: positions at or past their request's prompt. A layer whose kernel
    is chosen per position (int4 decode with dense prompts, layers/quantization.py) computes these rows with one
    kernel and the others with another, so a token's bits depend on its position only, never on its batch."""

    mask: np.ndarray  # [M] bool, host side: True where the row is a generated token
    index: torch.Tensor  # [count] int64, the generated rows
    prompt_index: torch.Tensor  # [M - count] int64, the other rows

    @classmethod
    def from_mask(cls, mask: np.ndarray) -> "GeneratedRows":
        """The split of `mask`'s rows (host-side bools)."""
        mask = np.asarray(mask, dtype=bool)
        return cls(mask, torch.from_numpy(np.flatnonzero(mask)), torch.from_numpy(np.flatnonzero(~mask)))

    @property
    def num_rows(self) -> int:
        """M: the rows of the call this split describes."""
        return len(self.mask)

    @property
    def count(self) -> int:
        """How many rows are generated tokens."""
        return len(self.index)

    def rows(self, rows: torch.Tensor | slice) -> "GeneratedRows":
        """The split of `rows` of this call (the LM head's sampled rows, a prompt-logprobs slice)."""
        picked = self.mask[rows] if isinstance(rows, slice) else self.mask[rows.cpu().numpy()]
        return GeneratedRows.from_mask(picked)


@dataclass(slots=True)
class ForwardContext:
    """What the layers of one forward pass see: the attention backend's metadata for this step; for
    models with recurrent mixers, each request's state slot (llmplug.layers.recurrent.RecurrentMetadata);
    when some request of the step runs with a LoRA adapter, which adapter slot each token uses."""

    attn_metadata: Any  # built once per step by the attention backend's `build`
    virtual_engine: int = 0
    recurrent_metadata: Any = None  # RecurrentMetadata; None for models without recurrent mixers
    lora_mapping: Any = None  # llmplug.lora.layers.LoRAMapping; None: no token uses an adapter
    generated_rows: GeneratedRows | None = None  # set where a layer picks its kernel per position; else None


# A context variable, not a module global: engines stepping in different threads (AsyncLLM runs its
# engine loop in its own thread) each see their own forward pass.
_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("llmplug_forward_context", default=None)


@contextlib.contextmanager
def forward_context(
    attn_metadata: Any, recurrent_metadata: Any = None, lora_mapping: Any = None,
    generated_rows: GeneratedRows | None = None,
) -> Iterator[ForwardContext]:
    """Make `attn_metadata` (and `recurrent_metadata`, the LoRA mapping, the generated rows) visible to the layers
    for the duration of one forward pass."""
    context = ForwardContext(
        attn_metadata, recurrent_metadata=recurrent_metadata, lora_mapping=lora_mapping, generated_rows=generated_rows
    )
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def current_lora_mapping() -> Any:
    """The LoRA mapping of the running forward pass (llmplug.lora.layers.LoRAMapping); None when no token of it
    uses an adapter, or outside one (logits computed without a context: the base model's)."""
    context = _current.get()
    return None if context is None else context.lora_mapping


def current_generated_rows() -> GeneratedRows | None:
    """Which rows of the running call are generated tokens; None outside a step that says so (every row a prompt
    row: a model called directly computes as its prompts do)."""
    context = _current.get()
    return None if context is None else context.generated_rows


def get_forward_context() -> ForwardContext:
    """The context of the running forward pass; an error outside one."""
    context = _current.get()
    if context is None:
        raise RuntimeError("Attention layer called outside `with forward_context(...)`: the model runner sets it")
    return context
