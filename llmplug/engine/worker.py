"""Worker: one process's device, model runner and KV cache."""

from __future__ import annotations

import logging
from typing import Any

import torch

from llmplug.communicators.parallel_state import (
    DistributedEnv,
    destroy_distributed_environment,
    init_distributed_environment,
    initialize_model_parallel,
)
from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.memory_profiling import MemoryProfile, kv_cache_bytes
from llmplug.engine.model_runner import KVCacheSpec, ModelRunner
from llmplug.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from llmplug.engine.sleep_mode import SleepingWeights, sleep_weights, wake_weights
from llmplug.engine.weight_update import WeightBatch, load_weight_batch
from llmplug.layers.attention import attention_layers, bind_kv_cache
from llmplug.layers.decoder.native_stack import release_native_stacks
from llmplug.layers.packed_linear import row_variant_weights
from llmplug.layers.recurrent import bind_state_cache
from llmplug.loaders.base import finish_loading
from llmplug.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# config keys that give a model's context length, as vLLM reads them (Bloom has none, MPT max_seq_len, ...)
CONTEXT_LENGTH_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_sequence_length", "max_seq_length", "seq_len",
)
DEFAULT_CONTEXT_LENGTH = 2048


def stated_context_length(hf_config: Any) -> int | None:
    """The smallest context length the config names under CONTEXT_LENGTH_KEYS, or None."""
    lengths = [v for v in (getattr(hf_config, key, None) for key in CONTEXT_LENGTH_KEYS) if isinstance(v, int)]
    return min(lengths) if lengths else None


def context_length_of(hf_config: Any) -> int:
    """The smallest context length the config names under CONTEXT_LENGTH_KEYS; 2048 (warned) when it names none."""
    stated = stated_context_length(hf_config)
    if stated is not None:
        return stated
    logger.warning(
        "the model's config has none of %s; assuming a context length of %d (set model.max_model_len to change it)",
        ", ".join(CONTEXT_LENGTH_KEYS), DEFAULT_CONTEXT_LENGTH,
    )
    return DEFAULT_CONTEXT_LENGTH


class Worker:
    """Sets up a device for one rank and runs the model runner's steps on it.

    `distributed_env` (rank, world size, how to meet the other ranks) is given when the worker is one
    of several; the worker then joins the world and builds the TP/PP/DP groups before the model.
    `registry` is the engine's plugin registry (or its copy in this process); default: the one
    `config.plugins` builds.
    """

    def __init__(self, config: EngineConfig, distributed_env: DistributedEnv | None = None,
                 registry: PluginRegistry | None = None):
        self.config = config
        self.distributed_env = distributed_env
        self.registry = registry or PluginRegistry.from_config(config.plugins)
        self.rank = distributed_env.rank if distributed_env else 0
        self.local_rank = distributed_env.local_rank if distributed_env else 0
        self.model_runner: ModelRunner | None = None
        self.sleeping_weights: SleepingWeights | None = None  # set by sleep() until the weights wake up

    def init_device(self) -> None:
        """Choose this rank's device from the devices it can see, join the process groups, seed its RNGs."""
        from llmplug.platforms import resolve_platform

        self.platform = resolve_platform(self.config.device.platform, self.registry)
        index = self.platform.visible_device_index(self.local_rank)
        self.platform.set_device(index)
        self.device = self.platform.device(index)
        if self.config.device.num_threads:
            torch.set_num_threads(self.config.device.num_threads)
        if self.distributed_env is not None:
            self._init_distributed()
        self.platform.seed_everything(self.config.model.seed)
        self.model_runner = ModelRunner(self.config, self.device, self.registry)

    def _init_distributed(self) -> None:
        """Join the world with the platform's backend and communicator, then build the parallel groups."""
        self.platform.prepare_distributed()
        communicator_cls = self.registry.load("llmplug.communicators", self.platform.get_communicator())
        init_distributed_environment(
            self.distributed_env,
            backend=self.platform.distributed_backend,
            device=self.device,
            communicator_cls=communicator_cls,
        )
        parallel = self.config.parallel
        initialize_model_parallel(
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            parallel.data_parallel_size,
            parallel.enable_expert_parallel,
        )

    def load_model(self) -> None:
        """Build the model and load its weights."""
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """How many KV blocks this worker can hold: the explicit count; else a byte budget (cache.kv_cache_memory,
        which the CPU platform sets by default) less the recurrent-state slots (allocated first: every request
        that runs needs one), turned into no more blocks than the engine can use; else what a memory profile or
        the free memory leaves (the engine caps those)."""
        cache = self.config.cache
        spec = self.model_runner.kv_cache_spec()
        if cache.num_blocks is not None:
            return cache.num_blocks
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif self.platform.profiles_memory:
            budget = kv_cache_bytes(self.profile_memory(), cache.memory_fraction)
        else:
            budget = self.platform.memory_for_kv_cache(cache.memory_fraction, self.device.index or 0)
        budget -= self._state_bytes(spec, budget)
        if not spec.block_bytes:  # no attention layer: blocks hold nothing and only count tokens
            return self._max_useful_blocks()
        if cache.kv_cache_memory is not None:
            return self._blocks_within_budget(spec, budget)
        num_blocks = max(budget // spec.block_bytes, 0)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, spec.block_size,
                    num_blocks * spec.block_bytes / 2**20)
        return int(num_blocks)

    def _blocks_within_budget(self, spec: KVCacheSpec, budget: int) -> int:
        """The blocks `budget` bytes hold, at most what max_num_seqs requests of max_model_len tokens can touch: a
        byte budget is a ceiling (every block is allocated zero-filled, so resident, at start). Logs which bound
        held."""
        useful = self._max_useful_blocks()
        num_blocks = min(max(budget // spec.block_bytes, 0), useful)
        mib = 2**-20
        demand = f"max_num_seqs {self.config.scheduler.max_num_seqs} x {self._request_shape()} = {useful} blocks"
        bound = "under" if num_blocks == useful else f"({useful * spec.block_bytes * mib:.0f} MiB) capped by"
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB): %s %s the budget of %.0f MiB (cache.kv_cache_memory)",
                    num_blocks, spec.block_size, num_blocks * spec.block_bytes * mib, demand, bound, budget * mib)
        return int(num_blocks)

    def _state_bytes(self, spec: KVCacheSpec, budget: int) -> int:
        """The recurrent-state slots' bytes; a ConfigError when the budget cannot hold them."""
        if spec.state_bytes:
            logger.info("recurrent state: %d slots of %.2f MiB (%.1f MiB)", spec.num_state_slots,
                        spec.state_slot_bytes / 2**20, spec.state_bytes / 2**20)
        if spec.state_bytes > budget:
            raise ConfigError(
                f"the recurrent state of scheduler.max_num_seqs={spec.num_state_slots} requests needs "
                f"{spec.state_bytes} bytes but the KV-cache budget is {budget}; lower scheduler.max_num_seqs or "
                "raise cache.kv_cache_memory / cache.memory_fraction"
            )
        return spec.state_bytes

    def _max_useful_blocks(self) -> int:
        """Blocks for max_num_seqs requests of max_model_len tokens, each with its cross blocks (an encoder-decoder
        model's encoder states, kv_cache.py): the engine uses no more (EngineCore caps the pool there too)."""
        block_size = self.config.cache.block_size
        blocks_per_seq = -(-self._max_model_len() // block_size) + -(-self._num_encoder_tokens() // block_size)
        return self.config.scheduler.max_num_seqs * blocks_per_seq

    def _max_model_len(self) -> int:
        """model.max_model_len, else the model's own limit (its position table, else its config's context length)."""
        runner = self.model_runner
        return (self.config.model.max_model_len or getattr(runner.model, "max_positions", None)
                or context_length_of(runner.hf_config))

    def _num_encoder_tokens(self) -> int:
        """The encoder states each request of an encoder-decoder model keeps in cross blocks (0 for any other)."""
        return getattr(self.model_runner.model, "num_encoder_tokens", 0)

    def _request_shape(self) -> str:
        """One request's most tokens, in words: "max_model_len N" (+ its encoder tokens where it has any)."""
        encoder = self._num_encoder_tokens()
        shape = f"max_model_len {self._max_model_len()}"
        return f"({shape} + {encoder} encoder tokens)" if encoder else shape

    def profile_memory(self) -> MemoryProfile:
        """Run a dummy step at the engine's limits and measure the device memory around it.

        Every worker profiles at the same time (the engine asks them all), so the collectives of tensor
        and pipeline parallelism inside the dummy step meet.
        """
        platform, device_id = self.platform, self.device.index or 0
        max_model_len = self.config.model.max_model_len or context_length_of(self.model_runner.hf_config)
        num_tokens = self.config.scheduler.token_budget(max_model_len)
        max_num_seqs = self.config.scheduler.max_num_seqs
        with self.model_runner.profile_step(num_tokens, max_num_seqs, max_model_len) as run_step:
            platform.synchronize()
            platform.reset_peak_memory_stats(device_id)
            before = platform.memory_allocated(device_id)
            run_step()
            platform.synchronize()
            peak = platform.peak_memory_allocated(device_id) - before
        platform.empty_cache()
        total = platform.total_memory(device_id)
        profile = MemoryProfile(total, total - platform.available_memory(device_id), max(0, peak))
        logger.info("memory profile of a %d-token step: %s", num_tokens, profile)
        return profile

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache."""
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step."""
        return self.model_runner.execute_model(scheduler_output)

    def kv_connector_handshake(self) -> object:
        """What this worker's KV connector tells the scheduler's at start (e.g. the blocks it holds already)."""
        return self.model_runner.kv_connector.get_handshake_metadata()

    def shutdown_kv_connector(self) -> None:
        """Let the KV connector finish its background work (pending block writes)."""
        self.model_runner.kv_connector.shutdown()

    def shutdown(self) -> None:
        """Leave the process groups."""
        if self.distributed_env is not None:
            destroy_distributed_environment()

    def model_info(self) -> dict:
        """Facts about the loaded model the engine needs (context length, vocabulary, layers; a pooling model's
        tasks and defaults, None for a generating one)."""
        runner = self.model_runner
        hf = runner.hf_config
        spec = runner.kv_cache_spec()
        # a position table shorter than the config says (RoBERTa's starts at pad_token_id + 1) is the limit
        positions = getattr(runner.model, "max_positions", None) or context_length_of(hf)
        return {
            "context_length": positions,
            # False where the config names no length (Mamba, Bloom: 2048 assumed): a longer max_model_len is fine
            "context_length_stated": bool(getattr(runner.model, "max_positions", None) or stated_context_length(hf)),
            "vocab_size": hf.vocab_size,
            "eos_token_id": getattr(hf, "eos_token_id", None),
            "block_bytes": spec.block_bytes,
            "pooling": runner.pooling_info,
            "num_state_slots": spec.num_state_slots,
            "row_variant": row_variant_weights(runner.model),
            # generated tokens computed by other kernels than prompts (int4 copies, the CPU attention's prompt tiles):
            # their KV blocks are named apart (kv_cache.py)
            "splits_generated_rows": runner.generated_rows_apart,
            # the width of prompt embeddings (model.enable_prompt_embeds): the model's, or the config's hidden_size
            "embedding_size": getattr(runner.model, "embedding_size", None) or getattr(hf, "hidden_size", None),
            # a multimodal model's placeholder token (the input processor expands each image into a run of them)
            "image_token_id": getattr(runner.model, "image_token_id", None)
            if getattr(runner.model, "supports_multimodal", False) else None,
            # an audio-language model's placeholder token (each clip expands into a run of them)
            "audio_token_id": getattr(runner.model, "audio_token_id", None)
            if getattr(runner.model, "supports_multimodal", False) else None,
            # prompt spans that attend both ways, never split across steps (multimodal.bidirectional_spans)
            "bidirectional_spans": getattr(runner.model, "bidirectional_spans", None),
            # an encoder-decoder model (Whisper): its prompts bring audio for the encoder (engine/encoder_decoder.py)
            "is_encoder_decoder": getattr(runner.model, "is_encoder_decoder", False),
            # the encoder states each of its requests keeps in cross blocks beside its decoder blocks (kv_cache.py)
            "num_encoder_tokens": getattr(runner.model, "num_encoder_tokens", 0),
        }

    # ---- LoRA adapters (called through Executor.collective_rpc) ----
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter into this rank's host cache."""
        self.model_runner.require_lora().add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter on this rank."""
        return self.model_runner.require_lora().remove_adapter(lora_int_id)

    # ---- between generations: new weights, sleep mode (called through Executor.collective_rpc) ----
    def update_weights(self, batch: WeightBatch) -> None:
        """Load checkpoint-named tensors into the model through its weight loaders (this rank keeps its shard)."""
        load_weight_batch(self.model_runner.model, batch)

    def finish_weight_update(self) -> None:
        """After the last batch: redo what derives from the weights (int4 copies of changed layers, decode mirrors)."""
        runner = self.model_runner
        finish_loading(runner.model, self.config.model, only_dense=True)
        runner.drop_compiled_forward("new weights")
        # rebinding the same caches drops the attention backend's per-layer state, computed with the old weights
        caches = [layer.kv_cache for layer in attention_layers(runner.model)]
        bind_kv_cache(runner.model, caches if all(c is not None for c in caches) else None, runner.attn_backend)

    def sleep(self, level: int) -> None:
        """Free the KV cache; level 1 moves the weights to host memory, level 2 frees them (see sleep_mode)."""
        runner = self.model_runner
        bind_kv_cache(runner.model, None, runner.attn_backend)  # the layers held the only references
        bind_state_cache(runner.model, None)
        runner.drop_compiled_forward("sleep")
        release_native_stacks(runner.model)  # they held the weights and the caches too
        self.sleeping_weights = sleep_weights(runner.model, level)
        self.platform.empty_cache()

    def wake_up(self, tags: list[str]) -> None:
        """Restore what `tags` name: "weights" (to this rank's device) and/or "kv_cache" (allocated anew)."""
        runner = self.model_runner
        if "weights" in tags:
            wake_weights(runner.model, self.sleeping_weights, self.device)
            self.sleeping_weights = None
        if "kv_cache" in tags:
            runner.initialize_kv_cache(runner.num_blocks)
