"""ModelRunner: turns a SchedulerOutput into one flattened forward pass and a sampled token per request
(or, for pooling requests, the model's pooled result: see engine/pooling.py)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.block_table import BlockTable
from llmplug.engine.encoder_cache import EncoderCache, split_deepstack
from llmplug.engine.multimodal import bidirectional_spans, check_engine as check_multimodal_engine
from llmplug.engine.pipeline_stage import PipelineStage
from llmplug.engine.prompt_embeds import check_engine as check_prompt_embeds_engine, step_inputs_embeds
from llmplug.engine.sampler import Sampler
from llmplug.engine.spec_decode.verifier import DraftVerifier
from llmplug.engine.sampling_state import SamplingState
from llmplug.engine.scheduler_output import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from llmplug.layers.attention import bind_kv_cache
from llmplug.layers.attention.cross_attention import CrossAttentionBatch, CrossBlocks
from llmplug.layers.compiled_forward import CompiledForward
from llmplug.layers.attention.spans import check_spans_supported
from llmplug.layers.forward_context import BidirectionalSpan, CommonAttentionMetadata, GeneratedRows, forward_context
from llmplug.layers.quantization import splits_generated_rows
from llmplug.layers.recurrent import (
    RecurrentMetadata,
    allocate_state_cache,
    bind_state_cache,
    build_recurrent_metadata,
    state_bytes_per_slot,
)
from llmplug.loaders import build_loader, resolve_load_format
from llmplug.lora.request import LoRARequest
from llmplug.plugins.kv_connectors.base import KVCacheLayout, KVConnectorOutput, KVConnectorRole

if TYPE_CHECKING:
    from llmplug.lora.layers import LoRAMapping
    from llmplug.engine.multimodal import MultiModalFeature
    from llmplug.lora.manager import LoRAManager
    from llmplug.plugins.kv_connectors.base import KVConnector

logger = logging.getLogger(__name__)

UNSAMPLEABLE = "no token can be sampled: the logits hold NaN or +inf, or every token is masked"


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """What one KV block costs and how many layers hold one; and what running requests hold beside them (recurrent-state
    slots). An encoder-decoder model's cross-attention keys and values take blocks of the same pool (cross blocks)."""

    num_layers: int  # attention layers (0 for a pure state-space model: blocks then only count tokens)
    block_elements: int  # cache elements of one block summed over the layers (layers may differ: MLA's latent)
    dtype: torch.dtype
    block_size: int
    num_state_slots: int = 0  # one per request that can run at once, for a model with recurrent mixers
    state_slot_bytes: int = 0  # one request's state across the recurrent layers

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers (K and V, or a latent layer's keys only)."""
        return self.block_elements * torch.empty((), dtype=self.dtype).element_size()

    @property
    def state_bytes(self) -> int:
        """Bytes of all recurrent-state slots, allocated before the blocks."""
        return self.num_state_slots * self.state_slot_bytes


_NO_PROMPT = np.iinfo(np.int64).max  # the prompt length of a request the runner holds no prompt for


@dataclass(slots=True)
class BatchInputs:
    """The flattened inputs of one step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    common: CommonAttentionMetadata
    sample_indices: torch.Tensor  # [S] positions in T whose hidden states produce logits
    sample_req_ids: list[str]
    samples_every_row: bool  # sample_indices is 0..T-1 (a decode step): the logits take the hidden states as they are
    recurrent: RecurrentMetadata | None = None  # models with recurrent mixers: each request's state slot
    generated_rows: GeneratedRows | None = None  # models whose layers pick a kernel per position: which rows


class ModelRunner:
    """Owns the model, its KV cache and the sampler of one worker."""

    def __init__(self, config: EngineConfig, device: torch.device, registry: PluginRegistry):
        self.config = config
        self.device = device
        self.registry = registry
        self.block_size = config.cache.block_size
        self.dtype = getattr(torch, config.model.dtype)
        self.model: torch.nn.Module | None = None
        self.attn_backend = registry.load("llmplug.attention", config.device.attention_backend or "torch_sdpa")
        self.sampling_state: SamplingState | None = None  # needs the vocabulary size: built by load_model
        self.sampler: Sampler | None = None
        self.num_state_slots = 0  # recurrent-state slots, set with the KV cache
        self.prompt_token_ids: dict[str, list[int]] = {}
        self.block_table = BlockTable(config.scheduler.max_num_seqs)  # each running request's KV blocks
        # prompt positions whose logprobs were sent, kept across preemption: a recomputed prefill sends none twice
        self.prompt_logprobs_sent: dict[str, int] = {}
        self.lora_manager: LoRAManager | None = None  # built by load_model when lora.enable_lora
        self.lora_of: dict[str, LoRARequest] = {}  # running requests that use an adapter
        self.prompt_embeds: dict[str, torch.Tensor] = {}  # running requests' prompts given as embeddings (model dtype)
        self.mm_features: dict[str, list] = {}  # running requests' images (MultiModalFeature), in prompt order
        self.encoder_cache = EncoderCache()  # their encoder outputs, by content hash
        # encoder-decoder models (Whisper): each running request's audio and its cross blocks (its encoder's keys and
        # values in every decoder layer's cache), and the requests whose encoder has not written them yet
        self.encoder_features: dict[str, MultiModalFeature] = {}
        self.cross_blocks: dict[str, CrossBlocks] = {}
        self.unencoded: set[str] = set()
        self.kv_connector: KVConnector | None = None  # the worker role of kv_transfer_config's connector
        # M-RoPE models (layers/mrope.py): each running request's prompt positions [3, P] and decode delta
        self.mrope_positions: dict[str, tuple[np.ndarray, int]] = {}
        self.span_kind: str | None = None  # the model's bidirectional_spans, set by load_model
        self.splits_generated_rows = False  # int4 copies for generated tokens only: steps name those rows

    # ---- set-up -------------------------------------------------------------------------------
    def load_model(self) -> None:
        """Build the model with the configured loader and load its weights."""
        if self.config.lora.enable_lora and self.config.device.compile:
            raise ConfigError(
                "device.compile cannot be combined with lora.enable_lora: the compiled forward freezes the weights "
                "it was captured with and would not see the adapters put into the LoRA slots; start without "
                "--compile (LoRA runs the model eager)"
            )
        fmt = resolve_load_format(self.config.model.model, self.config.load.format)
        loader = build_loader(self.registry, fmt, self.config.load)
        self.model = loader.load_model(self.config, device=self.device)
        check_prompt_embeds_engine(self.config, self.model)
        check_multimodal_engine(self.config, self.model)
        self.stage = PipelineStage(self.model)
        self.uses_mrope = hasattr(self.model, "get_mrope_input_positions")  # its positions are [3, T]
        self.is_encoder_decoder = getattr(self.model, "is_encoder_decoder", False)  # steps take cross-attention
        if self.is_encoder_decoder and self.config.speculative_config.method is not None:
            raise ConfigError(f"{type(self.model).__name__} is an encoder-decoder model, whose drafts would need its "
                              "encoder states: start without speculative_config")
        self.deepstack_layers = getattr(self.model, "deepstack_layers", 0)  # its image rows are wider (encoder_cache)
        # prompt spans attending both ways (multimodal.bidirectional_spans): Gemma 3's images, PaliGemma's prompt
        self.span_kind = getattr(self.model, "bidirectional_spans", None)
        self.splits_generated_rows = splits_generated_rows(self.model)
        # the KV blocks of generated tokens are named apart (kv_cache.py) where some layer computes generated rows
        # with other kernels than prompt rows: int4 linears (above) or the attention backend (its prompt kernel)
        self.generated_rows_apart = self.splits_generated_rows or any(
            self.attn_backend.computes_prompt_rows_apart(layer, self.dtype, self.device, self.block_size)
            for layer in self._attention_layers()
        )
        if self.span_kind is not None:
            check_spans_supported(type(self.model).__name__, self.attn_backend, self._attention_layers())
        # what a step calls: the model, or its forward captured by torch.compile (device.compile)
        self.forward: Callable[..., object] = CompiledForward(self.model) if self.config.device.compile else self.model
        self.hf_config = loader.load_hf_config(self.config.model)
        if getattr(self.model, "supports_multimodal", False):  # vocabulary and context are the language model's
            self.hf_config = self.hf_config.get_text_config()
        self.sampling_state = SamplingState(vocab_size=self.hf_config.vocab_size, device=self.device)
        # processors contributed by `llmplug.hooks` plugins apply to every request
        hook = self.registry.hook_manager().hook
        global_processors = [p for found in hook.llmplug_logits_processors(config=self.config) for p in found]
        self.sampler = Sampler(logits_processors=global_processors)
        self.verifier = DraftVerifier(self.sampling_state)
        self.eagle = None  # speculative decoding with an EAGLE head: the runner drafts
        if self.config.speculative_config.method in ("eagle", "eagle3"):
            from llmplug.engine.spec_decode.eagle import EagleProposer

            self.eagle = EagleProposer(self.config, self.model, self.device, self.dtype)
        if global_processors and self.config.speculative_config.method is not None:
            raise ConfigError(
                "speculative_config cannot be combined with engine-wide logits processors (llmplug_logits_processors "
                "hook): verified draft positions would skip them"
            )
        self.pooling_info: dict | None = None  # a pooling model's tasks and defaults (None: it generates)
        if getattr(self.model, "is_pooling_model", False):
            from llmplug.engine.pooling import pooling_info
            from llmplug.layers.pooler import PoolingType

            path = loader.model_path(self.config.model.model)
            self.pooling_info = pooling_info(self.model, self.hf_config, self.config, path)
            self.pooling_type = PoolingType(self.pooling_info["pooling_type"])
        if self.config.lora.enable_lora:
            from llmplug.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, self.config.lora, self.dtype, self.device)

    def drop_compiled_forward(self, why: str) -> None:
        """Run the model eager from now on: a compiled (frozen) forward holds the weights it was compiled with."""
        if self.forward is not self.model:
            logger.info("%s: the compiled forward holds the old weights; running the model eager", why)
            self.forward = self.model

    def require_lora(self) -> LoRAManager:
        """The adapter manager; an error naming the setting when LoRA is off."""
        if self.lora_manager is None:
            raise RuntimeError("LoRA adapters need the engine started with lora.enable_lora=True")
        return self.lora_manager

    def kv_cache_spec(self) -> KVCacheSpec:
        """The shape of this worker's share of the KV cache and recurrent state."""
        attn_layers = self._attention_layers() + (self.eagle.attention_layers() if self.eagle is not None else [])
        shapes = [self.attn_backend.layer_kv_cache_shape(layer, 1, self.block_size) for layer in attn_layers]
        slot_bytes = state_bytes_per_slot(self.model, self.dtype)
        # every request that can run at once holds a slot, so a slot never has to be waited for
        num_slots = self.config.scheduler.max_num_seqs if slot_bytes else 0
        block_elements = sum(math.prod(shape) for shape in shapes)
        return KVCacheSpec(len(attn_layers), block_elements, self.dtype, self.block_size, num_slots, slot_bytes)

    def _attention_layers(self) -> list[torch.nn.Module]:
        from llmplug.layers.attention import Attention

        return [m for m in self.model.modules() if isinstance(m, Attention)]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one cache tensor per attention layer (and the state slots of each recurrent layer) and bind
        them to the layers (0 blocks: a pooling engine, whose prompts run whole, binds the backend without any cache)."""
        self.num_blocks = num_blocks
        if num_blocks == 0:
            bind_kv_cache(self.model, None, self.attn_backend)
            return
        shapes = [
            self.attn_backend.layer_kv_cache_shape(layer, num_blocks, self.block_size)
            for layer in self._attention_layers()
        ]
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes]
        bind_kv_cache(self.model, caches, self.attn_backend)
        if self.eagle is not None:
            self.eagle.allocate_cache(num_blocks, self.attn_backend, self.dtype, self.device)
        self.num_state_slots = self.kv_cache_spec().num_state_slots
        bind_state_cache(self.model, allocate_state_cache(self.model, self.num_state_slots, self.dtype, self.device))
        if self.config.kv_transfer_config.kv_connector is not None:
            self._register_kv_connector()

    def _register_kv_connector(self) -> None:
        """Build the KV connector's worker role once and hand it the (new) paged tensors."""
        from llmplug.engine import kv_transfer

        layers = self._attention_layers()
        if self.kv_connector is None:
            import torch.distributed as dist

            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            shapes = [self.attn_backend.layer_kv_cache_shape(layer, 1, self.block_size) for layer in layers]
            fingerprint = kv_transfer.cache_fingerprint(self.config, self.attn_backend.__name__, shapes, rank, world)
            layout = KVCacheLayout(self.block_size, self.kv_cache_spec().block_bytes, fingerprint, rank)
            self.kv_connector = kv_transfer.build_connector(self.config, self.registry, KVConnectorRole.WORKER, layout)
        self.kv_connector.register_kv_caches(kv_transfer.layer_caches(self.attn_backend, layers, self.block_size))

    @contextlib.contextmanager
    def profile_step(self, num_tokens: int, num_seqs: int, max_model_len: int) -> Iterator[Callable[[], None]]:
        """A dummy step of `num_tokens` prompt tokens over up to `num_seqs` requests (none longer than
        max_model_len), to measure its peak memory.

        On entering, a KV cache just large enough is allocated and bound (so that it is not counted in
        the peak); the yielded function runs the forward pass, the logits of every request and a float32
        softmax over them (the sampler's working set); on leaving, the cache is released.
        """
        num_tokens = min(num_tokens, num_seqs * max_model_len)  # what the scheduler could ever put in a step
        num_seqs = max(1, min(num_seqs, num_tokens))
        lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
        requests = [ScheduledRequest(f"profile-{i}", [0] * n, 0, samples=True, new=None, state_slot=i)
                    for i, n in enumerate(lens)]
        # request i holds the next num_blocks[i] blocks after those of the requests before it
        num_blocks = np.array([-(-n // self.block_size) for n in lens], dtype=np.int64)
        column = np.arange(num_blocks.max())
        block_tables = np.where(column < num_blocks[:, None], (np.cumsum(num_blocks) - num_blocks)[:, None] + column, 0)
        self.initialize_kv_cache(int(num_blocks.sum()))
        batch = self.prepare_inputs(requests, block_tables)

        @torch.inference_mode()
        def run() -> None:
            with forward_context(self.attn_backend.build_metadata(batch.common), batch.recurrent):
                hidden_states = self.stage.run(self.forward, batch.input_ids, batch.positions)
            if hidden_states is not None:  # the last pipeline stage
                torch.softmax(self.model.compute_logits(hidden_states[batch.sample_indices]), dim=-1)

        try:
            yield run
        finally:
            bind_kv_cache(self.model, None, self.attn_backend)  # the layers held the only references
            bind_state_cache(self.model, None)

    # ---- one step -----------------------------------------------------------------------------
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.block_table.apply(scheduler_output)
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.sampling_state.remove_request(req_id)
            self.prompt_token_ids.pop(req_id, None)
            self.lora_of.pop(req_id, None)
            self.prompt_embeds.pop(req_id, None)  # a resumed request brings them again
            self.mm_features.pop(req_id, None)
            self.mrope_positions.pop(req_id, None)
            self.encoder_features.pop(req_id, None)  # a resumed request brings its audio and cross blocks again
            self.cross_blocks.pop(req_id, None)
            self.unencoded.discard(req_id)
        for req_id in scheduler_output.finished_req_ids:
            self.prompt_logprobs_sent.pop(req_id, None)
        for req in scheduler_output.requests:
            if req.new is not None and req.new.pooling_params is None:  # pooling requests need no sampling state
                new = req.new
                # penalties see an embeddings prompt's generated tokens only: its prompt has no tokens
                prompt = [] if new.prompt_embeds is not None else new.prompt_token_ids
                self.sampling_state.add_request(
                    new.req_id, new.sampling_params, prompt, new.output_token_ids, new.eos_token_ids
                )
                self.prompt_token_ids[new.req_id] = new.prompt_token_ids
                if new.lora_request is not None:
                    self.lora_of[new.req_id] = new.lora_request
                if new.prompt_embeds is not None:
                    self.prompt_embeds[new.req_id] = new.prompt_embeds.to(self.device, self.dtype)
                if new.mm_features:
                    self.mm_features[new.req_id] = new.mm_features
                if new.encoder_feature is not None:
                    self._add_encoder_input(new)
                if self.uses_mrope:  # once per request (and again when a preempted one resumes)
                    self.mrope_positions[new.req_id] = self.model.get_mrope_input_positions(
                        new.prompt_token_ids, new.mm_features or [])

    def _add_encoder_input(self, new: NewRequestData) -> None:
        """Keep an encoder-decoder request's audio and cross blocks; unless they hold its keys and values already (a
        prefix-cache hit), its encoder runs at this step."""
        self.encoder_features[new.req_id] = new.encoder_feature
        self.cross_blocks[new.req_id] = CrossBlocks.of(new.cross_block_ids, new.encoder_feature.length, self.device)
        if not new.cross_blocks_written:
            self.unencoded.add(new.req_id)

    def prepare_inputs(self, reqs: list[ScheduledRequest], block_tables: np.ndarray) -> BatchInputs:
        """Flatten the scheduled tokens of all requests into one batch (numpy, then one copy to torch);
        `block_tables` [len(reqs), max_blocks]: each request's KV blocks, zero-padded."""
        bs = self.block_size
        query_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        computed = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        seq_lens = computed + query_lens
        query_start_loc = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        # positions: computed[i] + 0..query_lens[i]-1 for each request, without a per-token loop
        req_index = np.repeat(np.arange(len(reqs)), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - query_start_loc[req_index] + computed[req_index]
        has_cache = block_tables.shape[1] > 0
        if has_cache:  # slot of each token: its block (from its request's table) * block_size + offset in block
            slot_mapping = block_tables[req_index, positions // bs] * bs + positions % bs
        else:  # a pooling engine's step: no KV cache, nothing is stored
            block_tables = np.zeros((len(reqs), 1), dtype=np.int64)
            slot_mapping = np.zeros(num_tokens, dtype=np.int64)
        input_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=num_tokens)
        prompts = (self.prompt_token_ids.get(r.req_id) for r in reqs)  # none for the profile run's: all prompt
        prompt_lens = np.fromiter((_NO_PROMPT if p is None else len(p) for p in prompts), dtype=np.int64,
                                  count=len(reqs))
        # the last position of each request that samples; with draft tokens, also each draft's position
        num_samples = np.fromiter((r.samples * (1 + len(r.spec_token_ids)) for r in reqs), dtype=np.int64,
                                  count=len(reqs))
        # row j of a request's n sample rows (ending at cumulative row C) is n..1 positions before the request's end
        num_sample_rows = int(num_samples.sum())
        rows_to_end = np.repeat(np.cumsum(num_samples), num_samples) - np.arange(num_sample_rows)
        sample_indices = np.repeat(query_start_loc[1:], num_samples) - rows_to_end
        on_device = _one_copy(self.device, input_ids=input_ids, positions=positions, query_start_loc=query_start_loc,
                              seq_lens=seq_lens, computed=computed, block_tables=block_tables,
                              slot_mapping=slot_mapping, sample_indices=sample_indices, prompt_lens=prompt_lens)
        common = CommonAttentionMetadata(
            query_start_loc=on_device["query_start_loc"],
            seq_lens=on_device["seq_lens"],
            num_computed_tokens=on_device["computed"],
            block_tables=on_device["block_tables"],
            slot_mapping=on_device["slot_mapping"],
            positions=on_device["positions"],
            prompt_lens=on_device["prompt_lens"],
            block_size=bs,
            num_reqs=len(reqs),
            num_tokens=num_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_list=tuple(query_lens.tolist()),
            seq_lens_list=tuple(seq_lens.tolist()),
            # an engine without a KV cache (pooling) runs each prompt whole, outside the mode's guarantee
            batch_invariant=self.config.model.batch_invariant_on and has_cache,
            bidirectional_spans=self._step_spans(reqs, query_start_loc) if self.span_kind is not None else (),
        )
        sample_req_ids = [r.req_id for r in reqs if r.samples]
        recurrent = None
        if self.num_state_slots:
            slots = np.fromiter((r.state_slot for r in reqs), dtype=np.int64, count=len(reqs))
            recurrent = build_recurrent_metadata(query_lens, computed, slots, self.device)
        generated = None
        if self.splits_generated_rows:  # a row is a generated token where its position is past its prompt
            generated = GeneratedRows.from_mask(positions >= prompt_lens[req_index])
        # every token samples (a request samples at most its chunk's tokens): the sample rows are 0..T-1, in order
        samples_every_row = num_sample_rows == num_tokens
        return BatchInputs(
            on_device["input_ids"], on_device["positions"], common, on_device["sample_indices"], sample_req_ids,
            samples_every_row, recurrent, generated,
        )

    def _step_spans(self, reqs: list[ScheduledRequest], query_start_loc: np.ndarray) -> tuple[BidirectionalSpan, ...]:
        """The bidirectional spans the step's chunks hold, each whole (the scheduler never splits one)."""
        spans = []
        for i, r in enumerate(reqs):
            prompt = self.prompt_token_ids.get(r.req_id)
            start, end = r.num_computed_tokens, r.num_computed_tokens + len(r.token_ids)
            if prompt is None or start >= len(prompt):
                continue
            for first, last in bidirectional_spans(self.span_kind, self.mm_features.get(r.req_id), len(prompt)):
                if first < end and last > start:
                    if first < start or last > end:
                        raise RuntimeError(f"request {r.req_id}: the step's chunk [{start}, {end}) splits the "
                                           f"bidirectional span [{first}, {last})")
                    spans.append(BidirectionalSpan(i, int(query_start_loc[i]) + first - start, first, last - first))
        return tuple(spans)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward pass and sample one token for every request whose chunk reaches its end; with KV
        connector work, load its blocks before and save after (none when a load failed: the step is recomputed)."""
        meta = scheduler_output.kv_connector_metadata
        if meta is None:
            return self._execute_model(scheduler_output)
        invalid = self.kv_connector.load_kv(meta)
        output = self._execute_model(scheduler_output)
        skip = {r.req_id for r in scheduler_output.requests} if invalid else set(output.failed)
        output.kv_connector_output = KVConnectorOutput(invalid, self.kv_connector.save_kv(meta, skip))
        return output

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if not scheduler_output.requests:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        requests = scheduler_output.requests
        batch = self.prepare_inputs(requests, self.block_table.gather([r.req_id for r in requests]))
        attn_metadata = self.attn_backend.build_metadata(batch.common)
        model_kwargs = self._model_kwargs(scheduler_output)
        lora_mapping = self._lora_mapping(scheduler_output, batch)
        # the encoder runs outside the step's attention context; a request whose image fails to encode ends alone
        mm_chunks, mm_failed = self._mm_chunks(scheduler_output)
        if mm_chunks and self.deepstack_layers:
            mm_chunks, model_kwargs["added_rows"] = split_deepstack(mm_chunks, self.deepstack_layers, self.device)
        if self.is_encoder_decoder:  # each request's encoder runs once, at its first step, outside the attention
            model_kwargs["cross_attention"], encoder_failed = self._cross_attention(requests)
            mm_failed.update(encoder_failed)
        try:
            with forward_context(attn_metadata, batch.recurrent, lora_mapping, batch.generated_rows):
                embeds_chunks = self._prompt_embeds_chunks(requests) + mm_chunks
                if embeds_chunks:  # (embedding lookups may be LoRA-adapted: inside the step's context)
                    model_kwargs["inputs_embeds"] = step_inputs_embeds(
                        self.model.embed_input_ids, batch.input_ids, embeds_chunks
                    )
                positions = self._mrope_step_positions(requests) if self.uses_mrope else batch.positions
                hidden_states = self.stage.run(self.forward, batch.input_ids, positions, **model_kwargs)
        except BaseException:
            self._discard_step(batch)
            raise
        if hidden_states is None:  # an earlier pipeline stage: the last one samples
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], failed=mm_failed)
        if self.pooling_info is not None:  # a pooling engine: every request pools
            pooled, failed = self._pool(scheduler_output, batch, hidden_states)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], pooler_output=pooled,
                                     failed={**failed, **mm_failed})
        prompt_logprobs = self._prompt_logprobs(scheduler_output, batch, hidden_states, lora_mapping)
        if not batch.sample_req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], prompt_logprobs=prompt_logprobs,
                                     failed=mm_failed)
        rows = None if batch.samples_every_row else batch.sample_indices
        logits = self._compute_logits(hidden_states, rows, lora_mapping, batch.generated_rows)
        req_ids = batch.sample_req_ids
        drafts = {r.req_id: r for r in scheduler_output.requests if r.spec_token_ids}
        if drafts:  # speculative decoding: verify the drafts, sample the other requests as usual
            output = self.verifier.verify(logits, req_ids, drafts, self.sample)
        else:
            output = self.sample(logits, req_ids, scheduler_output.grammar_bitmask)
        if self.eagle is not None:
            output.draft_token_ids = self.eagle.propose(scheduler_output, hidden_states, output, self)
        output.prompt_logprobs = prompt_logprobs
        output.failed.update(mm_failed)
        output.corrupted.difference_update(mm_failed)  # its image failed: that is why it ends
        return output

    def _discard_step(self, batch: BatchInputs) -> None:
        """A forward pass failed: let the attention backend clear what it may have left half-written."""
        for layer in self._attention_layers():
            layer.backend.discard_step(layer, batch.common.slot_mapping)

    def sample(self, logits: torch.Tensor, req_ids: list[str], bitmask: torch.Tensor | None) -> ModelRunnerOutput:
        """One token per row of `logits` [len(req_ids), V], recorded in the sampling state."""
        out = self.sampler(logits, self.sampling_state.metadata(req_ids), bitmask)
        # one device-to-host copy for the tokens and the rows that could not be sampled
        sampled, unsampleable = torch.stack((out.sampled_token_ids, out.unsampleable.long())).tolist()
        sampled_token_ids = [[token] for token in sampled]
        for req_id, token_ids in zip(req_ids, sampled_token_ids):
            self.sampling_state.append_output(req_id, token_ids)
        failed = {}
        if any(unsampleable):
            failed = {req_ids[row]: UNSAMPLEABLE for row, bad in enumerate(unsampleable) if bad}
        corrupted = set(failed)
        failed.update((req_ids[row], why) for row, why in out.failed_rows.items())
        corrupted.difference_update(req_ids[row] for row in out.failed_rows)  # a raising processor is its own reason
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids, logprobs=out.logprobs,
                                 failed=failed, corrupted=corrupted)

    def _prompt_embeds_chunks(self, requests: list[ScheduledRequest]) -> list[tuple[int, torch.Tensor]]:
        """(first row in the step, rows) of the prompt embeddings that the step's positions of each request take."""
        if not self.prompt_embeds:
            return []
        chunks, row = [], 0
        for r in requests:
            embeds = self.prompt_embeds.get(r.req_id)
            if embeds is not None and r.num_computed_tokens < len(embeds):
                chunks.append((row, embeds[r.num_computed_tokens : r.num_computed_tokens + len(r.token_ids)]))
            row += len(r.token_ids)
        return chunks

    def _mm_chunks(self, scheduler_output: SchedulerOutput) -> tuple[list[tuple[int, torch.Tensor]], dict[str, str]]:
        """(first row in the step, rows) of the encoder outputs that fill the step's image placeholders, computing
        the images not cached (each once, whatever the chunking) after dropping those the scheduler evicted; and
        the requests whose image failed to encode, with why (they end; their rows keep the placeholder
        embeddings, which no other request attends to, and their blocks are never named in the prefix cache)."""
        self.encoder_cache.drop(scheduler_output.free_encoder_identifiers)
        if not self.mm_features:
            return [], {}
        chunks, failed, row = [], {}, 0
        for r in scheduler_output.requests:
            features = self.mm_features.get(r.req_id)
            start, end = r.num_computed_tokens, r.num_computed_tokens + len(r.token_ids)
            if features and features[-1].end > start:
                needed = [f for f in features if f.offset < end and f.end > start]
                try:
                    self.encoder_cache.ensure(self.model, needed, self.device, self.dtype)
                except Exception as error:  # this request's image: the batch goes on without it
                    logger.warning("request %s: encoding its image failed: %r", r.req_id, error)
                    failed[r.req_id] = f"encoding its image failed: {error!r}"
                else:
                    chunks += [(row + offset, rows)
                               for offset, rows in self.encoder_cache.step_rows(needed, start, end)]
            row += len(r.token_ids)
        return chunks, failed

    def _cross_attention(self, requests: list[ScheduledRequest]) -> tuple[CrossAttentionBatch, dict[str, str]]:
        """The step's cross-attention inputs (each request's rows and cross blocks), running the encoder of the
        requests whose blocks are not written yet; and those whose encoder failed, with why (they end; the batch goes
        on). A request that shares the cross blocks of a clip whose encoder failed in this step fails with it."""
        failed_clips: dict[str, str] = {}  # content hash -> why its encoder failed
        for r in requests:
            if r.req_id in self.unencoded:
                self.unencoded.discard(r.req_id)
                feature = self.encoder_features[r.req_id]
                why = self._encode(r.req_id, feature)
                if why is not None:
                    failed_clips[feature.identifier] = why
        failed = {r.req_id: failed_clips[clip] for r in requests
                  if (clip := self.encoder_features[r.req_id].identifier) in failed_clips}
        starts = tuple(itertools.accumulate((len(r.token_ids) for r in requests), initial=0))
        blocks = tuple(None if r.req_id in failed else self.cross_blocks[r.req_id] for r in requests)
        return CrossAttentionBatch(starts, blocks), failed

    def _encode(self, req_id: str, feature: MultiModalFeature) -> str | None:
        """Run a request's encoder alone (so its keys and values never depend on the step) into its cross blocks;
        why it failed, or None."""
        try:
            frames = feature.data["input_features"].to(self.device, self.dtype)
            self.model.encode(frames, self.cross_blocks[req_id])
        except Exception as error:  # this request's audio: the batch goes on without it
            logger.warning("request %s: encoding its audio failed: %r", req_id, error)
            return f"encoding its audio failed: {error!r}"
        self.encoder_cache.num_encoder_calls += 1
        return None

    def _mrope_step_positions(self, requests: list[ScheduledRequest]) -> torch.Tensor:
        """[3, T] M-RoPE positions of the step's tokens: a prompt token's from its request's prompt positions, a
        later one's its sequence position plus the request's delta on every stream (vLLM's mrope_position_delta)."""
        chunks = []
        for r in requests:
            prompt, delta = self.mrope_positions[r.req_id]
            start, end = r.num_computed_tokens, r.num_computed_tokens + len(r.token_ids)
            cut = min(max(start, prompt.shape[1]), end)  # prompt tokens of the chunk end here
            generated = np.arange(cut, end, dtype=np.int64) + delta
            chunks += [prompt[:, start:cut], np.broadcast_to(generated, (3, end - cut))]
        return torch.from_numpy(np.concatenate(chunks, axis=1)).to(self.device)

    def _model_kwargs(self, scheduler_output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Inputs beyond token ids and positions: token types (segments of text pairs) for models that take them."""
        if not getattr(self.model, "accepts_token_type_ids", False):
            return {}
        requests = scheduler_output.requests
        types = [t for r in requests for t in ((r.new and r.new.token_type_ids) or [0] * len(r.token_ids))]
        return {"token_type_ids": torch.tensor(types, dtype=torch.int64, device=self.device)}

    def _pool(
        self, scheduler_output: SchedulerOutput, batch: BatchInputs, hidden_states: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        from llmplug.engine.pooling import pool

        starts = [0, *itertools.accumulate(batch.common.query_lens_list)]
        return pool(self.model, scheduler_output, starts, hidden_states, self.pooling_type)
    def _lora_mapping(self, scheduler_output: SchedulerOutput, batch: BatchInputs) -> LoRAMapping | None:
        """Which adapter slot each token of the step uses; None when no request of the step has an adapter."""
        if not self.lora_of:
            return None
        loras = [self.lora_of.get(r.req_id) for r in scheduler_output.requests]
        return self.lora_manager.mapping(loras, np.asarray(batch.common.query_lens_list, dtype=np.int64))

    def _compute_logits(
        self, hidden_states: torch.Tensor, rows: torch.Tensor | slice | None, lora_mapping: LoRAMapping | None,
        generated: GeneratedRows | None = None,
    ) -> torch.Tensor:
        """The logits of `rows` of the step's hidden states (None: all of them, as they are); an LM head adapted by
        a LoRA adapter sees which adapter each row's request uses, one with int4 rows for generated tokens which
        rows those are."""
        if rows is not None:
            hidden_states = hidden_states[rows]
            lora_mapping = None if lora_mapping is None else lora_mapping.rows(rows)
            generated = None if generated is None else generated.rows(rows)
        if lora_mapping is None and generated is None:
            return self.model.compute_logits(hidden_states)
        with forward_context(None, lora_mapping=lora_mapping, generated_rows=generated):
            return self.model.compute_logits(hidden_states)

    def _prompt_logprobs(
        self, scheduler_output: SchedulerOutput, batch: BatchInputs, hidden_states: torch.Tensor,
        lora_mapping: LoRAMapping | None = None,
    ) -> dict[str, object]:
        """Logprobs of each prompt token given the ones before it, for requests that asked."""
        from llmplug.engine.sampler import compute_prompt_logprobs

        result: dict[str, object] = {}
        starts = [0, *itertools.accumulate(batch.common.query_lens_list)]  # host copies: no device read
        for i, req in enumerate(scheduler_output.requests):
            prompt = self.prompt_token_ids.get(req.req_id)
            if prompt is None or req.num_computed_tokens >= len(prompt):
                continue
            k = self.sampling_state.params(req.req_id).prompt_logprobs
            if k is None:
                continue
            # position p predicts token p + 1; only positions whose next token is a prompt token, not sent before
            start_pos = max(req.num_computed_tokens, self.prompt_logprobs_sent.get(req.req_id, 0))
            end_pos = min(req.num_computed_tokens + len(req.token_ids), len(prompt) - 1)
            if end_pos <= start_pos:
                continue
            first_row = starts[i] + start_pos - req.num_computed_tokens
            rows = slice(first_row, first_row + end_pos - start_pos)
            targets = torch.tensor(prompt[start_pos + 1 : end_pos + 1], device=self.device)
            logits = self._compute_logits(hidden_states, rows, lora_mapping)
            result[req.req_id] = compute_prompt_logprobs(logits, targets, k)
            self.prompt_logprobs_sent[req.req_id] = end_pos
        return result


def _one_copy(device: torch.device, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
    """The int64 arrays on `device` through a single host-to-device copy: packed, copied, viewed apart."""
    packed = torch.from_numpy(np.concatenate([a.ravel() for a in arrays.values()])).to(device, non_blocking=True)
    views = packed.split([a.size for a in arrays.values()])
    return {name: view if a.ndim == 1 else view.view(a.shape) for (name, a), view in zip(arrays.items(), views)}
