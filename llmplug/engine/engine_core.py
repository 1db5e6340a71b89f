"""EngineCore: the step loop — schedule, execute on the workers, update requests."""

from __future__ import annotations

import itertools
import logging
import os
from typing import TYPE_CHECKING, Iterable

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError, EngineDeadError, EngineStateError, InvalidRequestError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.batch_invariance import settle_row_invariance
from llmplug.engine.guided_decoding import grammar_bitmask, wait_for_any
from llmplug.engine.kv_cache import KVCacheManager
from llmplug.engine.output_processor import EngineCoreOutput
from llmplug.engine.request import Request, RequestStatus
from llmplug.engine.scheduler import Scheduler
from llmplug.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from llmplug.engine.spec_decode.speculator import RunnerDrafts, Speculator
from llmplug.engine.step_histogram import StepHistogram
from llmplug.engine.sleep_mode import SLEEP_TAGS, check_sleep_level, check_wake_tags
from llmplug.engine.weight_update import weight_batches
from llmplug.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

    from llmplug.plugins.kv_connectors.base import KVConnector

logger = logging.getLogger(__name__)

# vLLM's switch for a max_model_len past the model's positions (a ConfigError without it)
ALLOW_LONG_MAX_MODEL_LEN = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"

# a pooling step's default token budget (vLLM's): no KV cache to share the memory with, and fewer, larger
# steps pool a batch faster; at least the context length, so that the longest prompt fits whole
POOLING_MAX_NUM_BATCHED_TOKENS = 32768
_LORA_LOADS = itertools.count(1)  # every adapter load of the process, numbered (never reused)
GRAMMAR_WAIT_S = 0.05  # longest a step with nothing else to do waits for a grammar (new requests wait too)


class EngineCore:
    """Owns the scheduler, the KV-cache manager and the executor; one `step()` is one forward pass.

    A pooling engine (`model_info["pooling"]` set) has no KV cache: its prompts run whole, once."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry):
        self.config = config
        executor_cls = registry.load("llmplug.executors", config.parallel.executor)
        self.executor = executor_cls(config, registry=registry)
        infos = self.executor.collective_rpc("model_info")
        self.model_info = infos[0]
        try:
            settle_row_invariance(config, sorted({weight for info in infos for weight in info["row_variant"]}))
        except ConfigError:
            self.executor.shutdown()
            raise
        self.pooling = self.model_info.get("pooling")  # the pooling model's tasks and defaults; None: it generates
        self.max_model_len = self._resolve_max_model_len()
        num_blocks = 0 if self.pooling else self._num_blocks()
        self.executor.initialize_cache(num_blocks)
        cache = config.cache
        self.kv_cache_manager = (
            None
            if self.pooling
            else KVCacheManager(
                num_blocks, cache.block_size, cache.enable_prefix_caching, self.model_info["num_state_slots"],
                self.model_info.get("bidirectional_spans"), self.model_info.get("splits_generated_rows", False),
            )
        )
        sched = config.scheduler
        budget = sched.token_budget(self.max_model_len)
        if self.pooling and sched.max_num_batched_tokens is None:
            budget = max(POOLING_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=sched.enable_chunked_prefill,
            policy=sched.policy,
            speculator=self._speculator(),
            max_loras=config.lora.max_loras if config.lora.enable_lora else None,
            max_num_encoder_input_tokens=sched.max_num_encoder_input_tokens,
            encoder_cache_size=sched.encoder_cache_size,
            kv_connector=self._kv_connector(registry),
            bidirectional_spans=self.model_info.get("bidirectional_spans"),
        )
        self.loras: dict[int, LoRARequest] = {}  # adapters loaded on the workers, by lora_int_id
        self.iteration_tokens = StepHistogram()  # tokens each step that ran put through the model
        # the load each adapter's K/V belong to: ids may be reused after a removal, loads never are
        self.lora_loads: dict[int, int] = {}
        self.asleep: frozenset[str] = frozenset()  # the SLEEP_TAGS that are asleep now
        self.dead_error: EngineDeadError | None = None  # set by a fatal error; every later step raises it

    def _speculator(self) -> Speculator | None:
        """Speculative decoding's proposer and counters, when the config asks for it."""
        spec = self.config.speculative_config
        if spec.method is None:
            return None
        if self.model_info["num_state_slots"] or self.pooling:
            raise ConfigError(
                "speculative_config needs a generating model whose cache can drop rejected draft tokens: a model "
                "with recurrent mixers (their state cannot be rolled back) or a pooling model cannot speculate"
            )
        proposer = None
        if spec.method == "draft_model":
            from llmplug.engine.spec_decode.draft_model import DraftModelProposer

            proposer = DraftModelProposer(self.config, self.model_info["vocab_size"], self.max_model_len)
        elif spec.method in ("eagle", "eagle3"):  # the model runner's head drafts
            proposer = RunnerDrafts()
        return Speculator(spec, proposer)

    def _kv_connector(self, registry: PluginRegistry) -> KVConnector | None:
        """The scheduler role of the configured KV connector, told what the workers hold already."""
        if self.config.kv_transfer_config.kv_connector is None:
            return None
        if self.pooling or not self.kv_cache_manager.enable_prefix_caching:
            raise ConfigError(
                f"kv_transfer_config.kv_connector={self.config.kv_transfer_config.kv_connector!r}: this model keeps "
                "no prefix-cached KV blocks to transfer (a pooling model, or one with recurrent state)"
            )
        from llmplug.engine.kv_transfer import build_connector
        from llmplug.plugins.kv_connectors.base import KVCacheLayout, KVConnectorRole

        layout = KVCacheLayout(self.config.cache.block_size, self.model_info["block_bytes"])
        connector = build_connector(self.config, registry, KVConnectorRole.SCHEDULER, layout)
        connector.set_handshake_metadata(self.executor.collective_rpc("kv_connector_handshake"))
        return connector

    def _resolve_max_model_len(self) -> int:
        model_len = self.model_info["context_length"]
        longest_input = (self.pooling or {}).get("max_seq_length")  # a sentence-transformers folder's
        if longest_input and model_len:
            model_len = min(model_len, longest_input)
        asked = self.config.model.max_model_len
        if asked is None:
            return int(model_len)
        if asked > model_len and self.model_info.get("context_length_stated", True):
            if os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1":
                raise ConfigError(
                    f"model.max_model_len={asked} exceeds the model's {model_len} positions: positions past them "
                    f"have no embedding (or rotary the model was not trained on); lower it, or set "
                    f"{ALLOW_LONG_MAX_MODEL_LEN}=1 where the model extrapolates (rope scaling)"
                )
            logger.warning("model.max_model_len=%d exceeds the model's %d positions (%s=1)", asked, model_len,
                           ALLOW_LONG_MAX_MODEL_LEN)
        return asked

    def _num_blocks(self) -> int:
        block_size = self.config.cache.block_size
        # an encoder-decoder request also holds its encoder's keys and values in cross blocks (kv_cache.py)
        num_cross_blocks = -(-self.model_info.get("num_encoder_tokens", 0) // block_size)
        blocks_per_seq = -(-self.max_model_len // block_size) + num_cross_blocks
        # more blocks than max_num_seqs full-length requests can use only feed the prefix cache;
        # the cap keeps the block pool's bookkeeping small for tiny models with huge budgets
        cap = self.config.scheduler.max_num_seqs * blocks_per_seq
        num_blocks = min(self.executor.determine_num_blocks(), cap)
        if num_blocks < 1:
            raise ConfigError(
                f"the KV cache has room for no block (one block needs {self.model_info['block_bytes']} bytes): "
                "raise cache.kv_cache_memory / cache.memory_fraction or set cache.num_blocks"
            )
        if num_blocks < blocks_per_seq:
            logger.warning(
                "KV cache holds %d blocks; one request of max_model_len=%d needs %d: long prompts will be rejected",
                num_blocks, self.max_model_len, blocks_per_seq,
            )
        return num_blocks

    def add_request(self, request: Request) -> None:
        """Queue a request (rejects one that can never fit, with InvalidRequestError)."""
        self._check_alive()
        if self.asleep:
            raise EngineStateError(
                f"the engine is asleep ({', '.join(sorted(self.asleep))}); call wake_up() before adding requests"
            )
        if request.lora_request is not None:
            request.lora_load = self.lora_loads.get(request.lora_int_id)
        self.scheduler.add_request(request)

    # ---- LoRA adapters ------------------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter on every worker (InvalidRequestError when it cannot be served)."""
        if not self.config.lora.enable_lora:
            raise InvalidRequestError(
                f"request names LoRA adapter {lora_request.lora_name!r}, but LoRA is off: start the engine "
                "with enable_lora=True (lora.enable_lora)", param="lora_request",
            )
        known = self.loras.get(lora_request.lora_int_id)
        if known == lora_request:
            return
        if known is not None:
            raise InvalidRequestError(
                f"lora_int_id={lora_request.lora_int_id} already names adapter {known.lora_name!r} "
                f"({known.lora_path}); remove it first or use another id", param="lora_request",
            )
        self.executor.collective_rpc("add_lora", (lora_request,))
        self.loras[lora_request.lora_int_id] = lora_request
        self.lora_loads[lora_request.lora_int_id] = next(_LORA_LOADS)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter from every worker; False when none was loaded under that id.

        Requests already using it keep it: the workers read it from its folder again if they need to.
        """
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self.executor.collective_rpc("remove_lora", (lora_int_id,))
        return True

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded now, in the order they were added."""
        return list(self.loras.values())

    def abort_requests(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish requests early (abort, or a stop string found by the output processor)."""
        self.scheduler.finish_requests(req_ids, status)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model once, and report each request's new tokens.

        A failure inside the step ends only the requests it concerns, with finish reason "abort" and the
        error: one row (non-finite logits, a logits processor or grammar that raised) ends its request; an
        exception from the step as a whole ends the step's requests. Their blocks are freed and the
        prefix-cache names of blocks the step was to write are taken back. Only a fatal error (see
        `is_fatal`) ends the engine: it raises EngineDeadError now and at every later call.
        """
        self._check_alive()
        scheduler_output = self.scheduler.schedule()
        try:
            runner_output = self._execute(scheduler_output)
            updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        except Exception as exc:
            if self.is_fatal(exc):
                self._die(scheduler_output, exc)
            return self._fail_step(scheduler_output, exc)
        except BaseException:  # KeyboardInterrupt and the like: clean up, then let it through
            self._abandon_step(scheduler_output)
            raise
        if self.kv_cache_manager is not None:  # a pooling engine keeps no KV cache
            self.kv_cache_manager.finish_step(runner_output.failed)
        if scheduler_output.num_scheduled_tokens:  # a step that only waited for grammars ran no model
            self.iteration_tokens.observe(scheduler_output.num_scheduled_tokens)
        return self._outputs(updated, runner_output)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the model on the step's batch; requests whose grammar raised are marked failed."""
        failed: dict[str, str] = {}
        if self.scheduler.guided:  # requests under a grammar: their rows of the token bitmask
            scheduler_output.grammar_bitmask, failed = grammar_bitmask(
                scheduler_output.requests, self.scheduler.guided, self.model_info["vocab_size"]
            )
            if not scheduler_output.requests and self.scheduler.compiling:  # only grammars to wait for: no spin
                wait_for_any([r.grammar for r in self.scheduler.compiling], timeout=GRAMMAR_WAIT_S)
        runner_output = self.executor.execute_model(scheduler_output)
        runner_output.failed.update(failed)
        runner_output.corrupted.difference_update(failed)  # its grammar raised: that is why it ends
        return runner_output

    def is_fatal(self, error: Exception) -> bool:
        """True when `error` leaves the engine unable to run another step.

        A dead worker or failed collective (EngineDeadError, from the executor), a device error (the
        device's context is lost), and any error while several workers run one step: a rank that raised
        may leave the others inside a collective, out of step for good.
        """
        import torch

        if isinstance(error, (EngineDeadError, torch.AcceleratorError)):
            return True
        parallel = self.config.parallel
        return parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1

    def _fail_step(self, scheduler_output: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """End the step's requests (not the engine) after an exception from the step as a whole."""
        logger.error("an engine step failed; aborting its %d requests", len(scheduler_output.requests), exc_info=error)
        why = f"the engine step failed: {error!r}"
        self._abandon_step(scheduler_output, why)
        # every request of the step ends here, also one a half-applied update had finished already
        return [
            EngineCoreOutput(req_id=r.req_id, new_token_ids=[], finish_reason="abort", error=why)
            for r in scheduler_output.requests
        ]

    def _abandon_step(self, scheduler_output: SchedulerOutput, why: str = "the engine step was interrupted") -> None:
        """Abort the step's unfinished requests and take back the block names the step gave."""
        if self.kv_cache_manager is not None:
            self.kv_cache_manager.abandon_step()
        if self.scheduler.kv_connector is not None:
            self.scheduler.kv_connector.step_failed()
        self.scheduler.fail_requests([r.req_id for r in scheduler_output.requests], why)

    def _die(self, scheduler_output: SchedulerOutput, error: Exception) -> None:
        """Remember a fatal error (every later call raises it) and raise it now."""
        self._abandon_step(scheduler_output, f"the engine failed: {error!r}")
        self.dead_error = error if isinstance(error, EngineDeadError) else EngineDeadError(
            f"the engine failed and cannot serve requests: {error!r}"
        )
        raise self.dead_error from error

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    def _outputs(self, updated: list[Request], runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """One output per request with news: tokens, an end, or prompt logprobs (of a chunk that sampled nothing)."""
        row_of = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        logprobs = runner_output.logprobs
        outputs = []
        for req in updated:
            row = None if req.error is not None else row_of.get(req.request_id)  # failed: no token
            new_tokens = runner_output.sampled_token_ids[row] if row is not None else []
            outputs.append(
                EngineCoreOutput(
                    req_id=req.request_id,
                    new_token_ids=new_tokens,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    # speculating requests come after the rows logprobs cover (they never ask for logprobs)
                    new_logprobs=logprobs.row(row) if (logprobs is not None and row is not None
                                                       and row < len(logprobs.logprobs)) else None,
                    prompt_logprobs=runner_output.prompt_logprobs.get(req.request_id),
                    num_cached_tokens=req.num_cached_tokens,
                    first_scheduled_time=req.first_scheduled_time,
                    error=req.error,
                    pooling_output=runner_output.pooler_output.get(req.request_id),
                )
            )
        # a prompt chunk that ends before the prompt does samples nothing, but its prompt logprobs go out too
        reported = {req.request_id for req in updated} if runner_output.prompt_logprobs else set()
        for req_id, chunk in runner_output.prompt_logprobs.items():
            if req_id not in reported and (req := self.scheduler.get_request(req_id)) is not None:
                outputs.append(
                    EngineCoreOutput(req_id, [], prompt_logprobs=chunk, num_cached_tokens=req.num_cached_tokens)
                )
        return outputs

    # ---- between generations: new weights, prefix cache, sleep mode (RL) -------------------------
    def update_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Load checkpoint-named tensors on every worker through the model's weight loaders; reset the prefix cache.

        A failure (unknown name, wrong shape) leaves the tensors before it loaded; the cache is reset anyway.
        """
        self._require_idle("update the weights")
        if "weights" in self.asleep:
            raise EngineStateError("the weights are asleep; call wake_up(tags=['weights']) before update_weights")
        connector = self.scheduler.kv_connector
        if connector is not None and not connector.reset_cache():
            raise EngineStateError(
                f"kv_transfer_config.kv_connector={self.config.kv_transfer_config.kv_connector!r} cannot forget its "
                "blocks, which new weights would make stale; start the engine without it to update weights"
            )
        try:
            for batch in weight_batches(weights):
                self.executor.collective_rpc("update_weights", (batch,))
        finally:
            self.executor.collective_rpc("finish_weight_update")
            self.reset_prefix_cache()  # no block computed with the old weights may be hit again

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (EngineStateError while requests hold blocks) and every cached encoder output
        (images); a pooling engine caches none."""
        if self.kv_cache_manager is not None and not self.kv_cache_manager.reset_prefix_cache():
            raise EngineStateError("the prefix cache can only be reset while no request is running")
        self.scheduler.encoder_cache.reset()  # the runner drops them with the next step

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (and offload, level 1, or discard, level 2, the weights) on every worker."""
        check_sleep_level(level)
        self._require_idle("sleep")
        if self.asleep:
            raise EngineStateError(f"the engine is already asleep ({', '.join(sorted(self.asleep))})")
        self.executor.collective_rpc("sleep", (level,))
        self.asleep = frozenset(SLEEP_TAGS)
        self.reset_prefix_cache()  # the cached K/V are gone

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Restore what `tags` name ("weights", "kv_cache"; None: both); waking what is awake does nothing."""
        waking = check_wake_tags(tags) & self.asleep
        if waking:
            self.executor.collective_rpc("wake_up", (sorted(waking),))
            self.asleep -= waking

    def _require_idle(self, action: str) -> None:
        if self.has_unfinished_requests():
            raise EngineStateError(
                f"cannot {action} while requests are running ({self.scheduler.num_running} running, "
                f"{self.scheduler.num_waiting} waiting); let them finish or abort them first"
            )

    def stats(self) -> dict:
        """Counters for logging and metrics (with speculative decoding, its draft and acceptance counts too)."""
        kv = self.kv_cache_manager
        stats = {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_waiting_deferred": self.scheduler.num_waiting_deferred,  # the rest of num_waiting: for capacity
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_usage": kv.usage if kv else 0.0,
            "prefix_cache_hit_rate": kv.prefix_cache_stats.hit_rate if kv else 0.0,
            # the counts behind the rate (tokens looked up, tokens found), for rate() over any window
            "prefix_cache_queries": kv.prefix_cache_stats.queries if kv else 0,
            "prefix_cache_hits": kv.prefix_cache_stats.hits if kv else 0,
            "iteration_tokens": self.iteration_tokens.snapshot(),  # a StepHistogramSnapshot
            # requests aborted because their logits could not be sampled or verified (NaN, +inf, all masked)
            "num_corrupted_requests": self.scheduler.num_corrupted_requests,
        }
        if self.model_info.get("image_token_id") is not None or self.model_info.get("audio_token_id") is not None:
            # a multimodal model: its encoder cache
            stats.update(mm_cache_queries=self.scheduler.encoder_cache.num_queries,
                         mm_cache_hits=self.scheduler.encoder_cache.num_hits)
        if self.scheduler.max_loras is not None:  # LoRA on: the adapters of running and of waiting requests
            stats.update(self._lora_adapters())
        if self.scheduler.speculator is not None:
            spec = self.scheduler.speculator.stats
            stats.update(
                spec_decode_num_drafts=spec.num_drafts,
                spec_decode_num_draft_tokens=spec.num_draft_tokens,
                spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
                spec_decode_acceptance_rate=spec.acceptance_rate,
                spec_decode_mean_accepted_length=spec.mean_accepted_length,
                spec_decode_num_accepted_tokens_per_pos=spec.num_accepted_tokens_per_pos,
            )
        return stats

    def _lora_adapters(self) -> dict:
        """Names of the adapters running requests use and of those waiting requests need, and the slot count."""
        running, waiting = set(), set()
        for request in self.scheduler.requests.values():
            if request.lora_request is not None:
                side = running if request.status is RequestStatus.RUNNING else waiting
                side.add(request.lora_request.lora_name)
        return {"running_lora_adapters": sorted(running), "waiting_lora_adapters": sorted(waiting),
                "max_loras": self.scheduler.max_loras}

    def shutdown(self) -> None:
        """Stop the executor (and a draft model's engine)."""
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.shutdown()
        if self.scheduler.kv_connector is not None:  # the workers finish their pending block writes
            self.executor.collective_rpc("shutdown_kv_connector")
        self.executor.shutdown()
