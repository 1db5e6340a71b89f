"""What the scheduler hands the model runner each step, and what the runner hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmplug.core.params import PoolingParams, SamplingParams
from llmplug.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

    from llmplug.engine.multimodal import MultiModalFeature
    from llmplug.plugins.kv_connectors.base import KVConnectorOutput


@dataclass(slots=True, frozen=True)
class NewRequestData:
    """Everything the worker needs to (re)build a request's state: sent on first scheduling and on resume."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before a preemption; [] for a fresh request
    sampling_params: SamplingParams | None  # None for a pooling request
    eos_token_ids: tuple[int, ...] = ()  # masked while fewer than min_tokens are generated
    pooling_params: PoolingParams | None = None  # a pooling request: its whole prompt is in this step
    token_type_ids: list[int] | None = None  # pooling: the segment of each prompt token, when given
    lora_request: LoRARequest | None = None  # the adapter the worker applies to its tokens
    prompt_embeds: torch.Tensor | None = None  # a prompt given as embeddings: the rows of its prompt positions
    mm_features: list[MultiModalFeature] | None = None  # a multimodal prompt's images (engine/multimodal.py)
    encoder_feature: MultiModalFeature | None = None  # an encoder-decoder request's audio (engine/encoder_decoder.py)
    # its cross blocks, which hold the encoder's keys and values in every decoder layer's cache (engine/kv_cache.py),
    # and whether they are written already (a prefix-cache hit: the worker does not run the encoder)
    cross_block_ids: list[int] = field(default_factory=list)
    cross_blocks_written: bool = False


@dataclass(slots=True, frozen=True)
class ScheduledRequest:
    """One request's share of a step: the tokens whose K/V this step computes."""

    req_id: str
    token_ids: list[int]  # all_token_ids[num_computed_tokens : num_computed_tokens + n], then spec_token_ids
    num_computed_tokens: int  # before this step
    samples: bool  # the chunk reaches the last known token, so a token is sampled
    new: NewRequestData | None  # set when the worker has no state for the request
    # the request's block table, as an update of the worker's copy (engine/block_table.py): keep its first
    # num_kept_blocks blocks, then new_block_ids (a new or resumed request: 0 kept, the whole table)
    num_kept_blocks: int = 0
    new_block_ids: list[int] = field(default_factory=list)
    # speculative decoding: draft tokens, the tail of token_ids, verified in this step (each position samples)
    spec_token_ids: list[int] = field(default_factory=list)
    # their draft distributions [len(spec_token_ids), V] when they were sampled; None: certain drafts (one-hot q)
    spec_probs: torch.Tensor | None = None
    pools: bool = False  # a pooling request's whole prompt: the model's pooler runs on it
    state_slot: int | None = None  # its recurrent-state slot (models with recurrent mixers only)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch plus the requests whose worker state must be dropped."""

    requests: list[ScheduledRequest]
    num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or aborted since the previous step
    preempted_req_ids: set[str]
    # guided decoding: [num_sampling_requests, ceil(V / 32)] int32, rows in logits order; None: no grammar
    grammar_bitmask: torch.Tensor | None = None
    # encoder outputs the scheduler's encoder cache evicted: the runner drops them (engine/encoder_cache.py)
    free_encoder_identifiers: list[str] = field(default_factory=list)
    # what the KV connector's workers do this step (loads, saves: engine/kv_transfer.py); None: nothing
    kv_connector_metadata: object | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    """The tokens sampled in one step, for the requests that sampled, in order; and the pooled results."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # one list per request: one token, or accepted drafts and one more
    logprobs: list | None = None
    prompt_logprobs: dict[str, object] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it could not be sampled
    # the ids among `failed` whose logits held NaN or +inf or masked every token (counted: vllm:corrupted_requests)
    corrupted: set[str] = field(default_factory=set)
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> its result (CPU, float32)
    # speculative decoding by the runner (EAGLE): request id -> the drafts it proposes for the request's next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # the KV connector's failed loads and unstored saves of the step (None: no connector work)
    kv_connector_output: KVConnectorOutput | None = None
