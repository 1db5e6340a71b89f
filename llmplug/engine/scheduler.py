"""Continuous batching: which requests compute how many tokens each step, within one token budget.

Each step running requests go first (one decode token, or their next prefill chunk), then waiting
requests are admitted in policy order while the budget, `max_num_seqs` and the KV cache allow. When a
running request cannot get a block, the lowest-priority (latest-arrived) running request is preempted:
its blocks are freed and it is recomputed from its tokens when it is admitted again.

A request under a grammar (guided decoding) waits outside the queue until its grammar is compiled,
while others run; its matcher sees every token appended and ends the request when it terminates.
Preemption keeps the output tokens, so the matcher's state stays valid across the recompute.

A pooling request (embeddings, classification) is admitted only when its whole prompt fits the
step's budget — an encoder sees the prompt at once, and pooling needs every token's hidden state —
holds no KV blocks, and finishes in the step that ran it. A pooling engine has no KV cache at all
(`kv_cache_manager` None).

With LoRA, the running requests use at most `max_loras` distinct adapters (the worker's device
slots): a waiting request of another adapter waits until one of them has no running request left.

A request with images (`mm_features`) is chunked like any other, anywhere inside an image's placeholders;
a chunk only stops before an image whose encoder output is not cached when the step's encoder budget or
the encoder cache cannot take it (engine/encoder_cache.py). For a model with bidirectional spans (Gemma 3's images,
PaliGemma's prompt: `bidirectional_spans`) a chunk never ends inside a span: it stops before one that does not fit
the step's budget left (the span waits for the next step), and a request with a span longer than the whole budget is
refused when it is added.

An encoder-decoder request (Whisper) is admitted only when its decoder blocks and its cross blocks (the encoder's
keys and values: ceil(encoder tokens / block_size), engine/kv_cache.py) fit together; both are freed when it finishes
or is preempted. A small cache therefore runs fewer transcriptions at once, and a request grows at most to the blocks
its cross blocks leave.

With a KV connector (`kv_connector`, engine/kv_transfer.py), a waiting request's blocks past its local prefix-cache
hit that the connector holds are loaded into new blocks before the forward pass of the step that admits it, and the
full blocks each step computes are offered to the connector to save. A request that read a block whose load failed
forgets that step and is recomputed from its tokens (its local prefix-cache hits still count; the connector is not
asked again for it), never answered from it.
"""

from __future__ import annotations

import itertools
import logging
import time
from bisect import insort
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Literal

from llmplug.core.errors import ConfigError, InvalidRequestError
from llmplug.engine.encoder_cache import EncoderCacheManager
from llmplug.engine.kv_cache import KVCacheManager, PrefixCacheStats
from llmplug.engine.kv_transfer import invalidated_blocks
from llmplug.engine.multimodal import bidirectional_spans, span_safe
from llmplug.engine.request import Request, RequestStatus
from llmplug.engine.request_queue import FcfsQueue, PriorityQueue, SortKey
from llmplug.engine.scheduler_output import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from llmplug.engine.spec_decode.draft import NO_DRAFT, Draft

if TYPE_CHECKING:
    from llmplug.engine.multimodal import MultiModalFeature
    from llmplug.engine.spec_decode.speculator import Speculator
    from llmplug.plugins.kv_connectors.base import KVConnector, KVConnectorOutput

logger = logging.getLogger(__name__)

@dataclass(slots=True, frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler's queues and cache, for stat loggers."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class Scheduler:
    """Builds each step's batch from running and waiting requests and applies the sampled tokens."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager | None,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: Literal["fcfs", "priority"] = "fcfs",
        speculator: Speculator | None = None,
        max_loras: int | None = None,
        max_num_encoder_input_tokens: int | None = None,
        encoder_cache_size: int | None = None,
        kv_connector: KVConnector | None = None,
        bidirectional_spans: str | None = None,
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduler.policy={policy!r} is not one of 'fcfs', 'priority'")
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.speculator = speculator  # speculative decoding: draft tokens for decoding requests
        self.max_loras = max_loras  # distinct adapters among the running requests; None: LoRA is off
        # multimodal prompts: image placeholders a step may encode, and the encoder outputs kept for reuse
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens or max_num_batched_tokens
        self.encoder_cache = EncoderCacheManager(encoder_cache_size or self.max_num_encoder_input_tokens)
        self._encoder_budget = self.max_num_encoder_input_tokens  # left in the step being scheduled
        # A request may not outgrow the whole cache either, or it would preempt itself forever.
        kv = kv_cache_manager
        self.max_num_tokens = max_model_len if kv is None else min(max_model_len, kv.num_blocks * kv.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: FcfsQueue | PriorityQueue = FcfsQueue() if policy == "fcfs" else PriorityQueue(self._sort_key)
        self.running: list[Request] = []  # sorted by _sort_key: the preemption victim is last
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self.compiling: list[Request] = []  # waiting for their grammar, outside `waiting` so others go ahead
        self.guided: dict[str, Request] = {}  # unfinished requests under a grammar (the step's bitmask rows)
        self._failed: list[Request] = []  # grammar failed to compile: finished, reported by the next update
        self.num_preemptions = 0
        self.num_corrupted_requests = 0  # aborted because their logits were not finite (vllm:corrupted_requests)
        self._sort_keys: dict[str, SortKey] = {}
        self._arrivals = itertools.count()
        self.kv_connector = kv_connector  # its scheduler role: blocks past the local prefix cache, saves
        self._recomputed_req_ids: set[str] = set()  # sent to the workers as preempted: their state is rebuilt
        self._load_failed: set[str] = set()  # unfinished requests that read a failed load: they compute their blocks
        self.span_kind = bidirectional_spans  # the model's (multimodal.bidirectional_spans): never split across steps

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; InvalidRequestError when it could never be scheduled."""
        self._check_fits(request)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in the scheduler")
        self.requests[request.request_id] = request
        seq = next(self._arrivals)
        self._sort_keys[request.request_id] = (
            (seq,) if self.policy == "fcfs" else (request.priority, request.arrival_time, seq)
        )
        request.status = RequestStatus.WAITING
        if request.grammar is None:
            self.waiting.push(request)
        else:
            self.guided[request.request_id] = request
            self.compiling.append(request)

    def _check_fits(self, request: Request) -> None:
        num_prompt = request.num_prompt_tokens
        where = f"request {request.request_id!r}: prompt of {num_prompt} tokens"
        if num_prompt == 0:
            raise InvalidRequestError(f"request {request.request_id!r}: the prompt is empty")
        if request.is_pooling != (self.kv_cache_manager is None):
            kind = "pooling" if request.is_pooling else "generation"
            raise InvalidRequestError(
                f"request {request.request_id!r}: a {kind} request in an engine that does not serve it"
            )
        if request.is_pooling:
            self._check_pooling_fits(request, where)
            return
        if num_prompt + 1 > self.max_model_len:
            raise InvalidRequestError(
                f"{where} plus one generated token exceeds max_model_len={self.max_model_len}; shorten the prompt"
            )
        kv = self.kv_cache_manager
        num_blocks = -(-(num_prompt + 1) // kv.block_size)
        num_cross = kv.num_cross_blocks(request)
        if num_blocks + num_cross > kv.num_blocks:
            cross = f" and {num_cross} cross blocks for its encoder's keys and values" if num_cross else ""
            raise InvalidRequestError(
                f"{where} plus one generated token needs {num_blocks} KV blocks of {kv.block_size} tokens{cross}, "
                f"but the cache holds {kv.num_blocks}; shorten the prompt or give the KV cache more memory"
            )
        for start, end in bidirectional_spans(self.span_kind, request.mm_features, num_prompt):
            if end - start > self.max_num_batched_tokens:
                raise InvalidRequestError(
                    f"{where} has a span of {end - start} tokens (at {start}) that attend to one another and run in "
                    f"one step, more than max_num_batched_tokens={self.max_num_batched_tokens}; raise "
                    "max_num_batched_tokens, or send a smaller image or a shorter prompt"
                )
        if not self.enable_chunked_prefill and num_prompt > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"{where} exceeds max_num_batched_tokens={self.max_num_batched_tokens} with chunked prefill "
                f"disabled; shorten the prompt, raise max_num_batched_tokens or enable chunked prefill"
            )

    def _check_pooling_fits(self, request: Request, where: str) -> None:
        if request.num_prompt_tokens > self.max_model_len:
            raise InvalidRequestError(f"{where} exceeds max_model_len={self.max_model_len}; shorten the prompt")
        if request.num_prompt_tokens > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"{where} exceeds max_num_batched_tokens={self.max_num_batched_tokens}, and pooling prompts "
                "run whole in one step; raise max_num_batched_tokens or shorten the prompt"
            )

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End waiting or running requests (abort, stop string); unknown or finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        req_ids = [req_ids] if isinstance(req_ids, str) else req_ids
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.compiling:
                self.compiling.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)

    def _free(self, request: Request, status: RequestStatus) -> None:
        """Mark a request finished and release everything the scheduler holds for it."""
        request.status = status
        if self.kv_cache_manager is not None:
            self.kv_cache_manager.free(request)
        if request.mm_features:
            self.encoder_cache.release(request)
        del self.requests[request.request_id]
        del self._sort_keys[request.request_id]
        self.guided.pop(request.request_id, None)
        self._load_failed.discard(request.request_id)
        self.finished_req_ids.add(request.request_id)

    def _sort_key(self, request: Request) -> SortKey:
        return self._sort_keys[request.request_id]

    # -- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts, allocating their KV blocks."""
        if self.compiling:
            self._admit_compiled()
        scheduled: list[ScheduledRequest] = []
        preempted: set[str] = set()
        self._encoder_budget = self.max_num_encoder_input_tokens
        budget = self._schedule_running(scheduled, preempted, self.max_num_batched_tokens)
        # After a preemption the cache is full: admitting new requests would only preempt again.
        if not preempted:
            self._schedule_waiting(scheduled, budget)
        output = SchedulerOutput(
            requests=scheduled,
            num_scheduled_tokens=sum(len(s.token_ids) for s in scheduled),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted | self._recomputed_req_ids,
            free_encoder_identifiers=self.encoder_cache.take_freed(),
        )
        self.finished_req_ids, self._recomputed_req_ids = set(), set()
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta()
        return output

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is compiled; finish those whose compile failed."""
        compiling, self.compiling = self.compiling, []
        for request in compiling:
            if not request.grammar.ready:
                self.compiling.append(request)
            elif request.grammar.error is not None:
                self._fail(request, f"its grammar failed to compile: {request.grammar.error}")
                self._failed.append(request)
            else:
                self.waiting.push(request)

    def _schedule_running(self, scheduled: list[ScheduledRequest], preempted: set[str], budget: int) -> int:
        """Schedule running requests in order; returns the budget left."""
        all_drafts = self._drafts(budget - 1)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new_tokens = self._num_new_tokens(request.num_tokens - request.num_computed_tokens, budget)
            num_new_tokens = self._whole_spans(request, request.num_computed_tokens, num_new_tokens)
            num_new_tokens, to_encode = self._encoder_inputs(request, request.num_computed_tokens, num_new_tokens)
            draft = NO_DRAFT
            if num_new_tokens == 1:
                draft = all_drafts.get(request.request_id, NO_DRAFT).truncated(budget - 1)
            # speculation never preempts: without free blocks for its drafts the request decodes one
            if draft.token_ids and not self.kv_cache_manager.allocate_slots(request, 1 + len(draft.token_ids)):
                draft = NO_DRAFT
            num_drafts = len(draft.token_ids)
            if num_new_tokens > 0 and self._allocate_or_preempt(request, num_new_tokens + num_drafts, preempted):
                self._use_encoder_inputs(request, request.num_computed_tokens, num_new_tokens, to_encode,
                                         admitted=False)
                scheduled.append(self._scheduled_request(request, num_new_tokens, new=None, draft=draft))
                budget -= num_new_tokens + num_drafts
            i += 1
        return budget

    def _drafts(self, budget: int) -> dict[str, Draft]:
        """Draft tokens to verify after each decoding request's last token, within `budget` and its length
        limits: one proposal for all of them (each is cut to the budget left when it is scheduled)."""
        if self.speculator is None:
            return {}
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        return self.speculator.propose([(r, self._draft_room(r, budget)) for r in decoding])

    def _draft_room(self, request: Request, budget: int) -> int:
        """How many draft tokens `request` may verify: within the budget, the context length and max_tokens."""
        max_tokens = request.sampling_params.max_tokens
        return min(budget, self._max_tokens(request) - request.num_tokens - 1,
                   max_tokens - request.num_output_tokens - 1 if max_tokens is not None else budget)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, preempted: set[str]) -> bool:
        """Allocate, preempting from the end of `running` until it fits; False if `request` itself went."""
        # The victim is always at or after `request` in `running`, so it was not scheduled this step.
        while not self.kv_cache_manager.allocate_slots(request, num_new_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks; it is recomputed from all_token_ids when resumed."""
        self.kv_cache_manager.free(request)
        if request.mm_features:  # its encoder outputs stay cached (evictable) for the recompute
            self.encoder_cache.release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        """Admit waiting requests in policy order until one does not fit (no overtaking)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.is_pooling:  # whole or not at all, and no KV blocks
                if request.num_tokens > budget:
                    break
                self.waiting.pop()
                scheduled.append(self._admit(request, 0, request.num_tokens))
                budget -= request.num_tokens
                continue
            if not self._adapter_fits(request):
                break
            computed_blocks, num_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_external = self._num_external_tokens(request, num_computed_tokens) if self.kv_connector else 0
            start = num_computed_tokens + num_external
            num_new_tokens = self._whole_spans(request, start, self._num_new_tokens(request.num_tokens - start, budget))
            num_new_tokens, to_encode = self._encoder_inputs(request, start, num_new_tokens)
            if num_new_tokens == 0 or not self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, computed_blocks, num_external
            ):
                break
            if num_external:
                self._load_external(request, len(computed_blocks), num_external)
            self._use_encoder_inputs(request, start, num_new_tokens, to_encode, admitted=True)
            self.waiting.pop()
            scheduled.append(self._admit(request, start, num_new_tokens))
            budget -= num_new_tokens

    def _num_external_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens past the local hit whose K/V the connector holds (none for a request that needs every prompt
        position's logits)."""
        if request.sampling_params.prompt_logprobs is not None or request.request_id in self._load_failed:
            return 0
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.kv_cache_manager.block_size]
        num_external = self.kv_connector.get_num_new_matched_tokens(request.request_id, hashes, num_computed_tokens)
        if self.span_kind is None or not num_external:
            return num_external
        spans = bidirectional_spans(self.span_kind, request.mm_features, request.num_prompt_tokens)
        block_size = self.kv_cache_manager.block_size
        return span_safe(spans, num_computed_tokens + num_external, block_size) - num_computed_tokens

    def _load_external(self, request: Request, num_local_blocks: int, num_external_tokens: int) -> None:
        """Tell the connector which of the request's new blocks receive the K/V it holds."""
        end = num_local_blocks + num_external_tokens // self.kv_cache_manager.block_size
        block_ids = self.kv_cache_manager.block_tables[request.request_id][num_local_blocks:end]
        self.kv_connector.update_state_after_alloc(
            request.request_id, list(zip(request.block_hashes[num_local_blocks:end], block_ids)))

    def _offer_computed_blocks(self, request: Request, start: int, num_new_tokens: int) -> None:
        """Offer the connector the full blocks the request's chunk [start, start + num_new_tokens) completes."""
        block_size = self.kv_cache_manager.block_size
        first, end = start // block_size, min((start + num_new_tokens) // block_size, len(request.block_hashes))
        if end > first:
            block_ids = self.kv_cache_manager.block_tables[request.request_id][first:end]
            self.kv_connector.request_computed_blocks(
                request.request_id, list(zip(request.block_hashes[first:end], block_ids)))

    def _whole_spans(self, request: Request, start: int, num_new_tokens: int) -> int:
        """The chunk [start, start + num_new_tokens) cut before a bidirectional span it would end inside (0: the
        request waits for a step with room for the span)."""
        if self.span_kind is None:
            return num_new_tokens
        end = start + num_new_tokens
        for span_start, span_end in bidirectional_spans(self.span_kind, request.mm_features, request.num_prompt_tokens):
            if span_start < end < span_end:
                return max(span_start - start, 0)
        return num_new_tokens

    def _encoder_inputs(
        self, request: Request, start: int, num_new_tokens: int
    ) -> tuple[int, list[MultiModalFeature]]:
        """The chunk [start, start + num_new_tokens) cut before the first image whose encoder output is not cached
        and that the step's encoder budget or the encoder cache cannot take (0: the request waits a step), and the
        images the chunk needs computed. An image larger than the budget is computed alone in a step."""
        end, to_encode, num_pending = start + num_new_tokens, [], 0
        for feature in request.mm_features or ():
            if feature.offset >= end or feature.end <= start or self.encoder_cache.has(feature.identifier):
                continue
            if any(f.identifier == feature.identifier for f in to_encode):
                continue
            alone = self._encoder_budget == self.max_num_encoder_input_tokens and not to_encode
            fits = alone or feature.length <= self._encoder_budget - num_pending
            if not (fits and self.encoder_cache.can_allocate(feature, num_pending)):
                return max(feature.offset - start, 0), to_encode
            to_encode.append(feature)
            num_pending += feature.length
        return num_new_tokens, to_encode

    def _use_encoder_inputs(
        self, request: Request, start: int, num_new_tokens: int, to_encode: list[MultiModalFeature], admitted: bool
    ) -> None:
        """Charge the step's encoder budget for `to_encode` and hold, for the request, every image its chunk fills.

        Each image item is counted as one encoder-cache lookup in the chunk that first reaches it: the chunk holding
        its first placeholder, or the first chunk after (re)admission, `admitted`, which may start inside it. It is a
        miss when this step computes it for this request (once: a repeat of the same image in the chunk is a hit)."""
        end, computing = start + num_new_tokens, {feature.identifier for feature in to_encode}
        for feature in request.mm_features or ():
            if feature.offset < end and feature.end > start and (admitted or feature.offset >= start):
                self.encoder_cache.count_lookup(hit=feature.identifier not in computing)
                computing.discard(feature.identifier)
        for feature in to_encode:
            self.encoder_cache.allocate(request, feature)
            self._encoder_budget -= feature.length
        for feature in request.mm_features or ():
            if feature.offset < end and feature.end > start:
                self.encoder_cache.use(request, feature)

    def _adapter_fits(self, request: Request) -> bool:
        """True when the request's adapter is running already or a device slot is left for it."""
        if request.lora_request is None or self.max_loras is None:
            return True
        running = {r.lora_int_id for r in self.running if r.lora_request is not None}
        return request.lora_int_id in running or len(running) < self.max_loras

    def _admit(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> ScheduledRequest:
        """Move a request whose blocks are allocated from waiting to running."""
        if request.status is RequestStatus.WAITING:  # first scheduling, not a resume
            request.num_cached_tokens = num_computed_tokens
            request.first_scheduled_time = request.first_scheduled_time or time.time()  # queue time ends here
        request.num_computed_tokens = num_computed_tokens
        request.status = RequestStatus.RUNNING
        insort(self.running, request, key=self._sort_key)
        cross_block_ids, cross_written = [], False
        if request.encoder_feature is not None:
            cross_block_ids, cross_written = self.kv_cache_manager.get_cross_blocks(request)
        new = NewRequestData(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            eos_token_ids=request.eos_token_ids,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
            token_type_ids=request.token_type_ids,
            prompt_embeds=request.prompt_embeds,
            mm_features=request.mm_features,
            encoder_feature=request.encoder_feature,
            cross_block_ids=cross_block_ids,
            cross_blocks_written=cross_written,
        )
        return self._scheduled_request(request, num_new_tokens, new)

    def _num_new_tokens(self, num_uncomputed: int, budget: int) -> int:
        """Tokens to compute this step: all of them, a chunk of `budget`, or 0 (wait for a bigger budget)."""
        if num_uncomputed <= budget:
            return num_uncomputed
        # Without chunked prefill only a recompute after preemption can be longer than any step's
        # budget (prompts that are were rejected); it is chunked rather than left waiting forever.
        if self.enable_chunked_prefill or num_uncomputed > self.max_num_batched_tokens:
            return budget
        return 0

    def _scheduled_request(
        self, request: Request, num_new_tokens: int, new: NewRequestData | None, draft: Draft = NO_DRAFT
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        reaches_end = start + num_new_tokens == request.num_tokens
        num_kept_blocks, new_block_ids = (0, []) if request.is_pooling else (
            self.kv_cache_manager.take_block_table_update(request, whole=new is not None))
        if self.kv_connector is not None:
            self._offer_computed_blocks(request, start, num_new_tokens)
        return ScheduledRequest(
            req_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new_tokens] + draft.token_ids,
            num_computed_tokens=start,
            samples=reaches_end and not request.is_pooling,
            new=new,
            num_kept_blocks=num_kept_blocks,
            new_block_ids=new_block_ids,
            spec_token_ids=draft.token_ids,
            spec_probs=draft.probs,
            pools=request.is_pooling,
            state_slot=None if request.is_pooling else self.kv_cache_manager.get_state_slot(request),
        )

    # -- results of a step ---------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled ones, apply stop checks; returns the requests with new tokens."""
        sampled = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
        if self.speculator is not None:
            self.speculator.receive(runner_output.draft_token_ids)
        updated = list(self._failed)  # finished without a token: they still need an output
        recomputed = set()
        if runner_output.kv_connector_output is not None:
            recomputed = self._apply_connector_output(scheduler_output, runner_output.kv_connector_output)
        for scheduled in scheduler_output.requests:
            request = self.requests.get(scheduled.req_id)
            if request is None or request.status is not RequestStatus.RUNNING or scheduled.req_id in recomputed:
                continue  # finished (aborted) after it was scheduled, or its step is void
            token_ids = sampled.get(scheduled.req_id)
            num_rejected = self._num_rejected(scheduled, token_ids)
            request.num_computed_tokens += len(scheduled.token_ids) - num_rejected
            if request.mm_features:  # images whose placeholders are all computed are needed no more
                self.encoder_cache.release(request, request.num_computed_tokens)
            if scheduled.req_id in runner_output.failed:  # this request alone ends; the batch goes on
                self.num_corrupted_requests += scheduled.req_id in runner_output.corrupted
                self._fail(request, runner_output.failed[scheduled.req_id])
                updated.append(request)
                continue
            if scheduled.pools:  # its result is in runner_output.pooler_output
                self._free(request, RequestStatus.FINISHED_STOPPED)
                updated.append(request)
                continue
            if scheduled.samples and token_ids:
                self._append_tokens(request, token_ids)
                updated.append(request)
                if num_rejected and not request.is_finished:  # the rejected drafts' K/V are garbage
                    self.kv_cache_manager.trim(request, request.num_computed_tokens)
        self._failed = []
        if any(request.is_finished for request in updated):
            self.running = [request for request in self.running if not request.is_finished]
        return updated

    def _apply_connector_output(self, scheduler_output: SchedulerOutput, output: KVConnectorOutput) -> set[str]:
        """Hand the connector its report; requeue for recompute the requests that read a block whose load failed
        (their step is void), and take back the names of every block holding invalid K/V. Returns those requests."""
        self.kv_connector.update_connector_output(output)
        if not output.invalid_block_ids:
            return set()
        kv = self.kv_cache_manager
        tables = {s.req_id: kv.block_tables.get(s.req_id, []) for s in scheduler_output.requests}
        req_ids, bad_blocks = invalidated_blocks(scheduler_output.requests, tables, kv.block_size,
                                                 output.invalid_block_ids)
        kv.forget_blocks(bad_blocks)
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self._recompute(request)
        return req_ids

    def _recompute(self, request: Request) -> None:
        """Requeue a running request to compute again from its tokens, as if it had not run yet."""
        logger.warning("request %s read KV blocks whose load failed: recomputing them", request.request_id)
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        if request.mm_features:
            self.encoder_cache.release(request)
        request.status = RequestStatus.WAITING  # as if never scheduled: its cached tokens are counted anew
        request.num_computed_tokens = 0
        self.waiting.push_front(request)
        self._recomputed_req_ids.add(request.request_id)
        self._load_failed.add(request.request_id)

    def _num_rejected(self, scheduled: ScheduledRequest, token_ids: list[int] | None) -> int:
        """Draft tokens of `scheduled` the target rejected (counted in the speculator's stats)."""
        num_drafts = len(scheduled.spec_token_ids)
        if not num_drafts:
            return 0
        num_accepted = len(token_ids) - 1 if token_ids else 0
        self.speculator.record(num_drafts, num_accepted)
        return num_drafts - num_accepted

    def fail_requests(self, req_ids: Iterable[str], error: str) -> None:
        """End the unfinished ones of `req_ids` because a step failed for them (their blocks are freed)."""
        # a half-applied update may have finished requests without taking them out of `running` yet
        self.running = [request for request in self.running if not request.is_finished]
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                logger.error("request %s aborted: %s", req_id, error)
                request.error = error
                self.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def _fail(self, request: Request, error: str) -> None:
        """End one request because something failed for it alone (the batch goes on)."""
        logger.error("request %s aborted: %s", request.request_id, error)
        request.error = error
        self._free(request, RequestStatus.FINISHED_ABORTED)

    def _append_tokens(self, request: Request, token_ids: list[int]) -> None:
        """Append sampled tokens up to the first stop; a stopped request is freed."""
        for token_id in token_ids:
            request.append_output_token(token_id)
            status = self._advance_grammar(request, token_id) or self._check_stop(request)
            if status is not None:
                self._free(request, status)
                return

    def _advance_grammar(self, request: Request, token_id: int) -> RequestStatus | None:
        """Feed the token to the request's grammar; a matcher that raises fails this request only."""
        if request.grammar is None:
            return None
        try:
            request.grammar.accept(token_id)
        except Exception as error:  # a backend's bug or limit: the request cannot go on, the others can
            request.error = f"its grammar failed on token {token_id}: {error!r}"
            logger.error("request %s aborted: %s", request.request_id, request.error)
            return RequestStatus.FINISHED_ABORTED
        return None

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """The finished status the last appended token causes, if any."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        # Stop tokens count as a stop even on the last allowed token: "stop" says more than "length".
        if request.num_output_tokens >= params.min_tokens:
            if last in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self._max_tokens(request):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _max_tokens(self, request: Request) -> int:
        """The most tokens the request may hold: max_model_len, and what the cache holds besides its cross blocks
        (more would preempt it forever)."""
        kv = self.kv_cache_manager
        if kv is None or request.encoder_feature is None:
            return self.max_num_tokens
        return min(self.max_num_tokens, (kv.num_blocks - kv.num_cross_blocks(request)) * kv.block_size)

    # -- queries -------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """True while any request waits (for its grammar too) or runs."""
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to be admitted (new, preempted, or for their grammar)."""
        return len(self.waiting) + len(self.compiling)

    @property
    def num_waiting_deferred(self) -> int:
        """Waiting requests held back by something other than room in the batch: their grammar still compiling, or
        their adapter needing a device slot while every slot serves another running adapter. The others of
        `num_waiting` wait for capacity: KV blocks, the step's token or encoder budget, max_num_seqs, or their turn."""
        deferred = len(self.compiling)
        if self.max_loras is not None:
            running = {r.lora_int_id for r in self.running if r.lora_request is not None}
            if len(running) >= self.max_loras:
                deferred += sum(r.lora_request is not None and r.lora_int_id not in running for r in self.waiting)
        return deferred

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        return self.requests.get(req_id)

    def make_stats(self) -> SchedulerStats:
        """A snapshot for stat loggers."""
        kv = self.kv_cache_manager
        prefix = kv.prefix_cache_stats if kv is not None else PrefixCacheStats()
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=kv.usage if kv is not None else 0.0,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
        )
