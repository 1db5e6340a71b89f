"""DataParallelEngine: `data_parallel_size` engine replicas (processes or Ray actors) behind LLMEngine's interface.

`LLM` and `AsyncLLM` (and so `llmplug serve`) build one when `parallel.data_parallel_size > 1` and drive it as
they drive an LLMEngine: `add_request` routes a request to a replica, `step` returns the outputs the replicas
sent since the last call. Each replica is a whole LLMEngine with its own executor (tensor x pipeline parallel
workers as configured), run by the backend `parallel.data_parallel_backend` names: a process of its own pinned to
its share of the cores (mp: dp_process.py, dp_placement.py), or a Ray actor placed by Ray (ray:
dp_ray_replica.py); see dp_replica.py for its loop and messages.

This front end tokenizes and checks every prompt with the replicas' own limits before routing it (a bad request
is refused here, at once, as LLMEngine refuses it), and routes by queue depth and prefix affinity
(dp_balancer.py). One thread per replica reads its messages and supervises it (dp_supervisor.py): when the
replica dies, or hangs (has requests and sends nothing for parallel.engine_iteration_timeout_s), its requests
end (finish_reason "abort", `error` naming the replica and how it ended), the others go on, and the replica is
started again (from the checkpoint: weights pushed by update_weights and LoRA adapters loaded at run time are not
restored). `replica_states()` reports each replica for /health and the metrics.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from llmplug.core.config import EngineConfig
from llmplug.core.errors import EngineDeadError, InvalidRequestError
from llmplug.core.outputs import PoolingRequestOutput, RequestMetrics, RequestOutput
from llmplug.core.params import PoolingParams, SamplingParams
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.aborted_output import aborted_output
from llmplug.engine.dp_balancer import LoadBalancer, prefix_keys
from llmplug.engine.dp_process import ProcessLauncher
from llmplug.engine.dp_replica import AbortRequests, AddRequest, Outputs, Ready
from llmplug.engine.dp_supervisor import Replica, ReplicaDied, ReplicaLauncher, ReplicaState, stop_all
from llmplug.engine.executors.main_guard import check_main_guard
from llmplug.engine.guided_decoding import GuidedDecodingManager
from llmplug.engine.input_processor import PromptType, is_embeds_prompt, is_multimodal_prompt
from llmplug.engine.llm_engine import LLMEngine, build_input_processor, prepare_config
from llmplug.engine.pooling import PoolingInfo
from llmplug.engine.step_histogram import StepHistogramSnapshot
from llmplug.loaders import build_loader
from llmplug.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

__all__ = ["DataParallelEngine", "ReplicaState", "build_engine", "merge_stats", "uses_replicas"]

logger = logging.getLogger(__name__)

POLL_S = 0.002  # how long `step` waits for outputs before it returns none (its caller then takes new requests)


def uses_replicas(config: EngineConfig) -> bool:
    """True when `config` asks for data-parallel replicas run by llmplug (not by an external launcher)."""
    parallel = config.parallel
    return parallel.data_parallel_size > 1 and parallel.executor != "external_launcher"


def build_launcher(config: EngineConfig, registry: PluginRegistry) -> ReplicaLauncher:
    """The data-parallel backend `parallel.data_parallel_backend` names: processes here (mp) or Ray actors."""
    if config.parallel.data_parallel_backend == "ray":
        from llmplug.engine.dp_ray_replica import RayLauncher  # imports ray

        return RayLauncher(config, registry)
    check_main_guard(f"{config.parallel.data_parallel_size} data-parallel replica processes")
    return ProcessLauncher(config, registry)


def build_engine(config: EngineConfig) -> LLMEngine | DataParallelEngine:
    """The engine `config` asks for: one LLMEngine, or replicas behind a DataParallelEngine."""
    return DataParallelEngine(config) if uses_replicas(config) else LLMEngine(config)


@dataclass(frozen=True, slots=True)
class KVCacheSummary:
    """What the server reads of the KV cache: the blocks of all replicas together."""

    num_blocks: int


@dataclass(slots=True)
class _Tracked:
    """An unfinished request: where it runs and what its final output needs if that replica dies."""

    replica: int
    generation: int  # of the replica process it was sent to
    params: SamplingParams | PoolingParams | None
    prompt_token_ids: list[int]
    arrival_time: float
    last: RequestOutput | None = None


class DataParallelEngine:
    """LLMEngine's interface over `data_parallel_size` replica processes (engine-thread use, like LLMEngine)."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None):
        self.registry = registry or PluginRegistry.from_config(config.plugins)
        self.config = prepare_config(config, self.registry)
        num_replicas = self.config.parallel.data_parallel_size
        loader = build_loader(self.registry, self.config.load.format, self.config.load)
        loader.download_model(self.config.model)  # once, here, before any replica starts
        self.tokenizer = None if self.config.model.skip_tokenizer_init else loader.load_tokenizer(self.config.model)
        replica_config = self.config.model_copy(deep=True)
        replica_config.parallel.data_parallel_size = 1
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.launcher = build_launcher(self.config, self.registry)
        self.replicas = [Replica(i, self.launcher, replica_config, self._events) for i in range(num_replicas)]
        self._finalizer = weakref.finalize(self, _stop, self.replicas, self.launcher)
        try:
            ready = [replica.wait_started() for replica in self.replicas][0]
        except BaseException:
            self.shutdown()
            raise
        info = ready.model_info
        self.engine_core = ReplicaCalls(self, ready)
        self.processor = build_input_processor(self.config, self.tokenizer, info, ready.max_model_len, self.registry)
        self.eos_token_ids = ready.eos_token_ids
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self.guided = GuidedDecodingManager(self.tokenizer, info["vocab_size"], self.eos_token_id, self.config.decoding,
                                            self.registry)
        self.pooling = PoolingInfo.from_model_info(info["pooling"]) if info.get("pooling") else None
        self.balancer = LoadBalancer(num_replicas, self.config.parallel.data_parallel_routing)
        self._requests: dict[str, _Tracked] = {}
        self._in_flight = [0] * num_replicas

    # --- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
                    *, priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Check the request, choose its replica and send it there (LLMEngine.add_request's contract)."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use; ids must be unique")
        prompt, token_ids, keys = self._prepare(prompt, params)
        states = [replica.serving() for replica in self.replicas]
        serving = [up for up, _ in states]
        if not any(serving):
            raise EngineDeadError("no data-parallel replica is serving now: "
                                  + "; ".join(f"{s.index}: {s.status}" for s in self.replica_states()))
        index = self.balancer.choose(keys, self._depths(), serving)
        arrival_time = arrival_time or time.time()
        generation = states[index][1]
        self.replicas[index].send(AddRequest(request_id, prompt, params, priority, arrival_time, lora_request),
                                  generation)
        self._requests[request_id] = _Tracked(index, generation, params, token_ids, arrival_time)
        self._count(index, 1)
        self.balancer.record(keys, index)

    def _prepare(self, prompt: PromptType, params: SamplingParams | PoolingParams | None
                 ) -> tuple[PromptType, list[int], list[int]]:
        """The prompt to send (token ids filled in: replicas tokenize nothing again), its ids and prefix keys.

        A generation prompt of text or token ids is checked as the replica will check it; a pooling, embeddings
        or image prompt is checked by its replica (its errors end the request) and routed by load alone."""
        block_size = self.config.cache.block_size
        if isinstance(params, PoolingParams) or is_embeds_prompt(prompt) or is_multimodal_prompt(prompt):
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            plain = isinstance(params, PoolingParams) and ids is not None
            return prompt, list(ids or []), prefix_keys(list(ids), block_size) if plain else []
        text, token_ids, _ = self.processor.process(prompt, params or SamplingParams())
        sent = dict(prompt) if isinstance(prompt, dict) else {"prompt": text}
        sent["prompt_token_ids"] = token_ids
        return sent, token_ids, prefix_keys(token_ids, block_size)

    def _depths(self) -> list[int]:
        """Each replica's queue: its unfinished requests as counted here, or as it reported (n > 1 counts n)."""
        depths = []
        for replica, in_flight in zip(self.replicas, self._in_flight):
            stats = replica.stats
            depths.append(max(in_flight, stats.get("num_waiting", 0) + stats.get("num_running", 0)))
        return depths

    def abort_request(self, request_ids: list[str]) -> None:
        """Stop requests (by the ids the user gave) in their replicas."""
        by_replica: dict[tuple[int, int], list[str]] = {}
        for request_id in request_ids:
            tracked = self._untrack(request_id)
            if tracked is not None:
                by_replica.setdefault((tracked.replica, tracked.generation), []).append(request_id)
        for (index, generation), ids in by_replica.items():
            self.replicas[index].send(AbortRequests(ids), generation)

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """The outputs the replicas sent since the last call (waiting up to POLL_S for the first)."""
        outputs: list[RequestOutput | PoolingRequestOutput] = []
        timeout: float | None = POLL_S
        while True:
            try:
                index, generation, message = self._events.get(timeout=timeout) if timeout else \
                    self._events.get_nowait()
            except queue.Empty:
                break
            timeout = None
            outputs.extend(self._handle(index, generation, message))
        if all(replica.status == "failed" for replica in self.replicas):
            raise EngineDeadError("every data-parallel replica failed and could not be restarted: "
                                  + "; ".join(str(r.last_error) for r in self.replicas))
        return outputs

    def _handle(self, index: int, generation: int, message: Outputs | ReplicaDied) -> list[Any]:
        if isinstance(message, ReplicaDied):
            self.balancer.forget(index)  # its prefix cache is gone
            lost = [rid for rid, t in self._requests.items() if t.replica == index and t.generation == generation]
            return [self._lost(rid, message.reason) for rid in lost]
        outputs = []
        for output in message.outputs:
            tracked = self._requests.get(output.request_id)
            if tracked is None or tracked.replica != index:  # aborted meanwhile
                continue
            if output.metrics is not None:
                output.metrics.engine_index = index  # its per-request metrics are this replica's
            tracked.last = output
            if output.finished:
                self._untrack(output.request_id)
            outputs.append(output)
        for request_id, error in message.rejected:
            if request_id in self._requests:
                outputs.append(self._lost(request_id, f"{type(error).__name__}: {error}"))
        return outputs

    def _lost(self, request_id: str, error: str) -> RequestOutput | PoolingRequestOutput:
        """The final output of a request its replica could not finish: aborted, with `error`."""
        tracked = self._untrack(request_id)
        metrics = RequestMetrics(tracked.arrival_time, engine_index=tracked.replica)
        if isinstance(tracked.params, PoolingParams):
            return PoolingRequestOutput(request_id, None, tracked.prompt_token_ids, True, metrics, error)
        output = aborted_output(request_id, tracked.last, tracked.params or SamplingParams(), error)
        if tracked.last is None:
            output.prompt_token_ids, output.metrics = tracked.prompt_token_ids, metrics
        return output

    def _untrack(self, request_id: str) -> _Tracked | None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            self._count(tracked.replica, -1)
        return tracked

    def _count(self, index: int, change: int) -> None:
        """Replica `index` has `change` more unfinished requests; its supervisor hears when it gets or loses all."""
        before = self._in_flight[index]
        self._in_flight[index] += change
        if (before > 0) != (self._in_flight[index] > 0):
            self.replicas[index].has_requests(self._in_flight[index] > 0)

    def has_unfinished_requests(self) -> bool:
        """True while any request is still running in some replica."""
        return bool(self._requests)

    # --- state ---------------------------------------------------------------------------------

    def replica_states(self) -> list[ReplicaState]:
        """Each replica's status, process and latest stats (thread-safe)."""
        return [replica.state() for replica in self.replicas]

    def get_tokenizer(self) -> Any | None:
        """The tokenizer the replicas use (None with skip_tokenizer_init)."""
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop every replica process."""
        self._finalizer()
        if hasattr(self, "guided"):
            self.guided.shutdown()


class ReplicaCalls:
    """What LLM and AsyncLLM call on an engine's `engine_core`, done on every serving replica.

    A replica restarted later starts from the checkpoint: it does not get what these calls changed."""

    def __init__(self, engine: DataParallelEngine, ready: Ready):
        self._engine = engine
        self.model_info = ready.model_info
        self.max_model_len = ready.max_model_len
        self.kv_cache_manager = KVCacheSummary(ready.num_blocks * len(engine.replicas))
        self._merged: tuple[tuple[int, ...], dict[str, Any]] = ((), {})  # (stats versions, merged stats)

    def stats(self) -> dict[str, Any]:
        """The replicas' stats merged (counts added, usage averaged, the prefix-cache rate recomputed); merged
        again only when a replica reported since (AsyncLLM reads them after every poll)."""
        versions = tuple(replica.stats_version for replica in self._engine.replicas)
        if versions != self._merged[0]:
            self._merged = (versions, merge_stats([s.stats for s in self._engine.replica_states() if s.stats]))
        return dict(self._merged[1])

    def _on_all(self, function: Callable[..., Any], *args: Any) -> list[Any]:
        """`function(engine, *args)` on every serving replica; the first error is raised."""
        replicas = [r for r in self._engine.replicas if r.serving()[0]]
        if not replicas:
            raise EngineDeadError("no data-parallel replica is serving now")
        futures = [replica.call(function, args) for replica in replicas]
        return [future.result() for future in futures]

    def update_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """New weights into every replica (sent once to each, on the CPU)."""
        self._on_all(_core_method, "update_weights", [(name, tensor.cpu()) for name, tensor in weights])

    def reset_prefix_cache(self) -> None:
        self._on_all(_core_method, "reset_prefix_cache")

    def sleep(self, level: int = 1) -> None:
        self._on_all(_core_method, "sleep", level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._on_all(_core_method, "wake_up", tags)

    def add_lora(self, lora_request: LoRARequest) -> None:
        self._on_all(_core_method, "add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return any(self._on_all(_core_method, "remove_lora", lora_int_id))

    def list_loras(self) -> list[LoRARequest]:
        return self._on_all(_core_method, "list_loras")[0]

    @property
    def asleep(self) -> bool:
        """True while anything sleeps in some replica."""
        return any(self._on_all(_asleep))


def _stop(replicas: list[Replica], launcher: ReplicaLauncher) -> None:
    """Stop every replica, then release the backend (a Ray cluster it started)."""
    stop_all(replicas)
    launcher.close()


def _core_method(engine: LLMEngine, name: str, *args: Any) -> Any:
    """Runs in a replica: `engine.engine_core.<name>(*args)`."""
    return getattr(engine.engine_core, name)(*args)


def _asleep(engine: LLMEngine) -> bool:
    """Runs in a replica: whether anything of it sleeps."""
    return bool(engine.engine_core.asleep)


_MEAN_KEYS = ("kv_cache_usage", "spec_decode_acceptance_rate", "spec_decode_mean_accepted_length")


def merge_stats(replica_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Stats of replicas as one engine's: numbers added, histograms and per-position lists added element by
    element, adapter names joined; usage and rates averaged, the prefix-cache hit rate from the merged counts."""
    if not replica_stats:
        return {}
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for stats in replica_stats for k in stats):
        values = [stats[key] for stats in replica_stats if key in stats]
        merged[key] = _merge(key, values)
    queries = merged.get("prefix_cache_queries", 0)
    if "prefix_cache_hit_rate" in merged:
        merged["prefix_cache_hit_rate"] = merged.get("prefix_cache_hits", 0) / queries if queries else 0.0
    return merged


def _merge(key: str, values: list[Any]) -> Any:
    first = values[0]
    if key in _MEAN_KEYS:
        return sum(values) / len(values)
    if isinstance(first, StepHistogramSnapshot):
        counts = tuple(sum(c) for c in zip(*(v.counts for v in values)))
        return StepHistogramSnapshot(first.bounds, counts, sum(v.sum for v in values), sum(v.count for v in values))
    if isinstance(first, bool) or key == "max_loras":
        return first
    if isinstance(first, (int, float)):
        return sum(values)
    if isinstance(first, (list, tuple)) and all(isinstance(x, (int, float)) for v in values for x in v):
        return [sum(x) for x in itertools.zip_longest(*values, fillvalue=0)]
    if isinstance(first, (list, tuple, set)):  # names (LoRA adapters in use)
        return sorted({x for v in values for x in v})
    return first
