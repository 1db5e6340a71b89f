"""A request inside the engine: its tokens, progress, blocks' hashes and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmplug.core.params import PoolingParams, SamplingParams
from llmplug.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

    from llmplug.engine.guided_decoding import RequestGrammar
    from llmplug.engine.multimodal import MultiModalFeature


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        """True for the three finished states."""
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish reason of a finished status."""
        return {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH": "length", "FINISHED_ABORTED": "abort"}.get(self.name)


@dataclass(eq=False)
class Request:
    """One sequence being generated. With `n` > 1 the engine makes one Request per completion,
    all sharing the prompt (and, through prefix caching, its KV blocks).

    A pooling request (`pooling_params` set, `sampling_params` None) runs its prompt once, whole, and
    finishes in that step with a pooled result; it holds no KV blocks."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_ids: tuple[int, ...] = ()  # every token that ends the sequence (the tokenizer's first), unless ignore_eos
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first scheduling
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.time() when it first got a place in the batch (metrics)
    stop_reason: int | str | None = None
    error: str | None = None  # why a step failed for this request (finished FINISHED_ABORTED)
    block_hashes: list[int] = field(default_factory=list)  # one per full block of all_token_ids
    grammar: RequestGrammar | None = None  # guided decoding: its compiled grammar and matcher
    pooling_params: PoolingParams | None = None  # set for pooling requests (task and defaults resolved)
    token_type_ids: list[int] | None = None  # pooling: the segment of each prompt token (text pairs)
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
    lora_load: int | None = None  # which load of that adapter (EngineCore numbers them): part of its blocks' names
    # a prompt given as embeddings [num_prompt_tokens, embedding_size] (CPU); prompt_token_ids are then placeholders
    prompt_embeds: torch.Tensor | None = None
    # a multimodal prompt's images in prompt order (engine/multimodal.py): kept across preemption for the recompute
    mm_features: list[MultiModalFeature] | None = None
    # an encoder-decoder request's encoder input (Whisper's audio, engine/encoder_decoder.py): kept across preemption
    encoder_feature: MultiModalFeature | None = None
    cross_block_hashes: list[int] = field(default_factory=list)  # names of its cross blocks (engine/kv_cache.py)

    @property
    def lora_int_id(self) -> int | None:
        """The id of its adapter, None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def is_pooling(self) -> bool:
        """True for a request that pools its prompt instead of generating."""
        return self.pooling_params is not None

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens."""
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        """True once the request stopped, hit its length or was aborted."""
        return self.status.finished
