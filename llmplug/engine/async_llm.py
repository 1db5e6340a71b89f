"""AsyncLLM: the engine for asyncio servers; `async for out in engine.generate(...)` streams a request.

One background thread builds the LLMEngine, owns it and runs its step loop, so a long step never blocks the
event loop that serves HTTP, and one thread runs all of the process's torch work (see `_start`). The two
sides talk through two channels only:
- commands (add, abort, calls such as update_weights or sleep, shutdown) go to the engine thread through a
  thread-safe queue, which the thread drains between steps; with nothing to run it blocks on that queue
  (no busy wait); a call's result or error comes back through a future;
- outputs go back through `loop.call_soon_threadsafe`, once per step and event loop, into one stream per
  request (`RequestStream`), which merges an output into an unread one: a consumer that falls behind
  costs one pending output, not one per step.
An error in adding one request (InvalidRequestError) reaches that request only. A failure inside a step
ends only the requests it concerns (their last output has finish_reason "abort" and `error` set; see
EngineCore.step). An exception that escapes a step is fatal (a dead worker, a device error): every
in-flight request fails with EngineDeadError, later calls raise it at once, and `check_health()` reports it.

With `data_parallel_size > 1` the engine thread drives a DataParallelEngine (data_parallel.py): the replicas are
processes of their own, and a replica that dies ends only its own requests (their outputs carry the error).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmplug.core.config import EngineConfig, load_config
from llmplug.core.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from llmplug.core.outputs import PoolingRequestOutput, RequestOutput
from llmplug.core.params import BeamSearchParams, PoolingParams, RequestOutputKind, SamplingParams
from llmplug.engine.aborted_output import aborted_output
from llmplug.engine.beam_search import next_token_logprobs, start_search, step_params
from llmplug.engine.input_processor import PromptType, is_multimodal_prompt
from llmplug.engine.data_parallel import DataParallelEngine, ReplicaState, uses_replicas
from llmplug.engine.executors.main_guard import check_main_guard
from llmplug.engine.llm_engine import LLMEngine
from llmplug.engine.request_stream import RequestStream
from llmplug.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM"]


# --- commands from the event loop to the engine thread ------------------------------------------


@dataclass(frozen=True, slots=True)
class _AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams | PoolingParams
    priority: int
    arrival_time: float
    lora_request: LoRARequest | None = None


@dataclass(frozen=True, slots=True)
class _AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class _Call:
    """Run `function` on the engine thread between steps; its result or exception goes to `future`."""

    function: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def run(self) -> None:
        try:
            self.future.set_result(self.function())
        except Exception as exc:  # noqa: BLE001 - delivered to the caller that asked
            self.future.set_exception(exc)


@dataclass(frozen=True, slots=True)
class _Shutdown:
    pass


_Command = _AddRequest | _AbortRequests | _Call | _Shutdown


class _Aborted:
    """Stream item: the request was aborted through `AsyncLLM.abort`."""


class AsyncLLM:
    """The engine driven by a background thread, with asyncio streaming of each request's outputs.

    `AsyncLLM(model=..., **engine_kwargs)` and `AsyncLLM(config=...)` take what `LLM` takes.
    """

    def __init__(self, model: str | None = None, *, config: str | Path | EngineConfig | None = None, **kwargs: Any):
        if model is not None:
            kwargs["model"] = model
        if not isinstance(config, EngineConfig):
            config = load_config(kwargs=kwargs, file=config, order=("file", "kwargs", "cli")).config
        engine_class = LLMEngine
        if uses_replicas(config):  # data_parallel_size > 1: replica processes
            engine_class = DataParallelEngine
            # checked here: the engine thread that builds it has no line of the user's script on its stack
            check_main_guard(f"{config.parallel.data_parallel_size} data-parallel replica processes")
        self._start(lambda: engine_class(config), config.model.model)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLM":
        """An AsyncLLM for a resolved EngineConfig."""
        return cls(config=config)

    @classmethod
    def from_engine(cls, llm_engine: LLMEngine, model_name: str | None = None) -> "AsyncLLM":
        """Drive an existing LLMEngine (e.g. `LLM(...).llm_engine`); nothing else may step it from now on."""
        self = cls.__new__(cls)
        self._start(lambda: llm_engine, model_name or llm_engine.config.model.model)
        return self

    def _start(self, make_engine: Callable[[], LLMEngine], model_name: str) -> None:
        """Start the engine thread; it builds the engine with `make_engine`, then runs the step loop.

        The engine is built on the thread that steps it, so one thread runs all of the process's torch
        work. A second thread that ran parallel ops (building on the caller's thread) keeps an idle OpenMP
        team; GNU OpenMP then counts more threads than cores and its workers sleep between parallel regions
        instead of spinning: one stream decoded 1.4-1.8x slower (docs/platforms.md, "CPU threading").
        """
        self.model_name = model_name  # the model as the user named it (config.model.model is resolved)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams and _dead_error across the two threads
        self._dead_error: EngineDeadError | None = None
        self._busy_since: float | None = None  # monotonic start of the engine thread's current work; None: idle
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run_engine_thread, args=(make_engine, built), name="llmplug-engine", daemon=True
        )
        self._thread.start()
        built.result()  # the engine is up, or its construction error is raised here

    def _run_engine_thread(self, make_engine: Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        """Build the engine (reporting success or the error through `built`), then run the step loop."""
        try:
            self.llm_engine = make_engine()  # from now on only this thread touches it
            self._stats: dict[str, Any] = self.llm_engine.engine_core.stats()
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the constructor raises it
            built.set_exception(exc)
            return
        built.set_result(None)
        self._run_engine_loop()

    # --- what servers read -------------------------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        """The resolved engine configuration."""
        return self.llm_engine.config

    @property
    def max_model_len(self) -> int:
        """The context length: prompt plus generated tokens."""
        return self.llm_engine.engine_core.max_model_len

    @property
    def pooling(self) -> Any | None:
        """A pooling engine's model tasks and defaults (`PoolingInfo`); None when the engine generates."""
        return self.llm_engine.pooling

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1."""
        return self.llm_engine.processor.vocab_size

    def get_tokenizer(self) -> Any | None:
        """The engine's tokenizer (None with skip_tokenizer_init); thread-safe to read."""
        return self.llm_engine.get_tokenizer()

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """A conversation rendered by the tokenizer's chat template, ready for generation."""
        return self.llm_engine.processor.apply_chat_template(messages, **kwargs)

    def stats(self) -> dict[str, Any]:
        """The engine's counters after its latest step: num_running, num_waiting, kv_cache_usage, ..."""
        return dict(self._stats)

    @property
    def is_dead(self) -> bool:
        """True once the engine loop failed or was shut down."""
        return self._dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine stopped, or None while it runs."""
        return self._dead_error

    def check_health(self) -> None:
        """Raise EngineDeadError when the engine can no longer serve requests."""
        if self._dead_error is not None:
            raise self._dead_error

    def replica_states(self) -> list[ReplicaState]:
        """Each data-parallel replica's state (process, restarts, stats); empty for one engine in this process."""
        engine = self.llm_engine
        return engine.replica_states() if isinstance(engine, DataParallelEngine) else []

    def busy_for(self) -> float:
        """Seconds the engine thread has spent on its current step or command (0.0 while it waits for work).

        A thread that runs steps back to back starts over at each one, so a large value means one step or
        command has not ended: a stalled engine, which `check_health` alone would not report.
        """
        since = self._busy_since  # one read: the engine thread may reset it meanwhile
        return 0.0 if since is None else max(time.monotonic() - since, 0.0)

    # --- requests ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as its tokens arrive, the last one with `finished=True`.

        With `lora_request` the request runs with that LoRA adapter (the engine needs enable_lora).

        Cancelling the consumer (or closing the generator early) aborts the request and frees its
        KV blocks. Raises InvalidRequestError for a bad request and EngineDeadError when the engine died.
        """
        params = sampling_params or SamplingParams()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        await self._compile_grammar(params)
        if params.bad_words:  # tokenized here, off the event loop and the engine thread (the engine reuses them)
            await asyncio.get_running_loop().run_in_executor(None, self.llm_engine.processor.bad_words_token_ids,
                                                             params)
        if is_multimodal_prompt(prompt):  # the processor runs off the event loop and the engine thread
            prompt = await asyncio.get_running_loop().run_in_executor(
                None, self.llm_engine.processor.process_multimodal, prompt)
        stream = self._register(request_id, delta=params.output_kind == RequestOutputKind.DELTA)
        self._commands.put(_AddRequest(request_id, prompt, params, priority, time.time(), lora_request))
        finished = False
        try:
            last: RequestOutput | None = None
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine forgot it already (failed add, dead engine)
                    raise item
                if isinstance(item, _Aborted):
                    finished = True
                    yield aborted_output(request_id, last, params)
                    return
                finished = item.finished
                last = item
                yield item
        finally:
            self._unregister(request_id)
            if not finished:  # the consumer went away: stop the request
                self._commands.put(_AbortRequests([request_id]))

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Check and compile the request's guided-decoding constraint before it is queued, in the engine's
        compile pool (neither the event loop nor the engine thread waits on it): a bad or too costly
        constraint is its InvalidRequestError here, and the engine finds the grammar compiled in its cache.
        The guided-decoding manager is thread-safe, the one part of the engine this thread touches."""
        if params.guided_decoding is not None:
            self.check_health()
            # shielded: a client that leaves must not cancel a compile that other requests may share
            await asyncio.shield(asyncio.wrap_future(self.llm_engine.guided.prepare(params.guided_decoding)))

    async def beam_search(
        self, prompt: PromptType, params: BeamSearchParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield one finished output whose `beam_width` completions are the best beams (see `LLM.beam_search`).

        Each step runs the running beams as requests of the engine's batch, beside any other request.
        """
        request_id = request_id or f"beam-{uuid.uuid4().hex}"
        search = start_search(self.llm_engine, prompt, params)  # checks only: reads no engine state
        step = step_params(params, self.llm_engine.eos_token_ids)
        while not search.done:
            ids = [f"{request_id}-{len(search.running[0].token_ids)}-{i}" for i in range(len(search.running))]
            finals = await asyncio.gather(*(
                _final(self.generate({"prompt_token_ids": tokens}, step, beam_id))
                for tokens, beam_id in zip(search.sequences(), ids)
            ))
            search.advance([next_token_logprobs(final) for final in finals])
        yield search.request_output(request_id, self.get_tokenizer())

    async def encode(
        self, prompt: PromptType, pooling_params: PoolingParams, request_id: str | None = None, *, priority: int = 0
    ) -> PoolingRequestOutput:
        """The pooled result of one prompt (a pooling engine). Cancelling the caller aborts the request;
        InvalidRequestError for a bad request, RequestFailedError when a failure inside a step ended it,
        EngineDeadError when the engine died."""
        request_id = request_id or f"pool-{uuid.uuid4().hex}"
        stream = self._register(request_id, delta=False)
        self._commands.put(_AddRequest(request_id, prompt, pooling_params, priority, time.time()))
        answered = False
        try:
            item = await stream.get()
            answered = True
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, _Aborted):
                raise InvalidRequestError(f"pooling request {request_id} was aborted")
            if item.outputs is None:
                raise RequestFailedError(f"pooling request {request_id} failed: {item.error}")
            return item
        finally:
            self._unregister(request_id)
            if not answered:  # the caller went away: stop the request
                self._commands.put(_AbortRequests([request_id]))

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests and free their KV blocks; their streams end with finish_reason "abort"."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._commands.put(_AbortRequests(request_ids))
        with self._lock:
            streams = [self._streams.pop(rid) for rid in request_ids if rid in self._streams]
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.put, _Aborted())

    # --- between generations: new weights, sleep mode (RL); run on the engine thread between steps ----

    async def update_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """`LLM.update_weights`: new weights through the model's weight loaders; no request may be running."""
        await self._call(lambda: self.llm_engine.engine_core.update_weights(weights))

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (no request may be running)."""
        await self._call(self.llm_engine.engine_core.reset_prefix_cache)

    async def sleep(self, level: int = 1) -> None:
        """`LLM.sleep`: free the KV cache (and offload or discard the weights); no request may be running."""
        await self._call(lambda: self.llm_engine.engine_core.sleep(level))

    async def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """`LLM.wake_up`: restore "weights", "kv_cache" or both (None)."""
        await self._call(lambda: self.llm_engine.engine_core.wake_up(tags))

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter now (InvalidRequestError when it cannot be served)."""
        await self._call(lambda: self.llm_engine.engine_core.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False when none was loaded under that id."""
        return await self._call(lambda: self.llm_engine.engine_core.remove_lora(lora_int_id))

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded now."""
        return await self._call(self.llm_engine.engine_core.list_loras)

    async def is_sleeping(self) -> bool:
        """True while anything is asleep."""
        return await self._call(lambda: bool(self.llm_engine.engine_core.asleep))

    async def _call(self, function: Callable[[], Any]) -> Any:
        """Run `function` on the engine thread; EngineDeadError when the engine is gone."""
        call = _Call(function)
        with self._lock:  # _fail_all fails queued calls under the same lock: none is left waiting forever
            if self._dead_error is not None:
                raise self._dead_error
            self._commands.put(call)
        return await asyncio.wrap_future(call.future)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread (in-flight requests fail with EngineDeadError) and release the workers."""
        if self._thread.is_alive():
            self._commands.put(_Shutdown())
            self._thread.join(timeout)

    def _register(self, request_id: str, delta: bool) -> RequestStream:
        with self._lock:
            if self._dead_error is not None:
                raise self._dead_error
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use; ids must be unique")
            stream = self._streams[request_id] = RequestStream(request_id, asyncio.get_running_loop(), delta)
        return stream

    def _unregister(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    # --- the engine thread -------------------------------------------------------------------

    def _run_engine_loop(self) -> None:
        """Between steps take every queued command; with no request to run, wait for one."""
        engine = self.llm_engine
        try:
            while self._apply_commands(block=not engine.has_unfinished_requests()):
                outputs = engine.step() if engine.has_unfinished_requests() else []
                # stats first: whoever sees an output also sees the stats of the step that made it
                self._stats = engine.engine_core.stats()
                self._publish(outputs)
                self._busy_since = time.monotonic()  # progress: the next step (or wait) starts now
        except Exception as exc:  # a broken step: no later step can be trusted
            logger.exception("the engine loop failed; failing every in-flight request")
            if isinstance(exc, EngineDeadError):
                self._fail_all(exc, exc.__cause__)
            else:
                self._fail_all(EngineDeadError(f"the engine failed and cannot serve requests: {exc!r}"), exc)
        else:
            self._fail_all(EngineDeadError("the engine was shut down"), None)
        finally:
            self._shutdown_workers()

    def _apply_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for the first when `block`); False once shutdown was asked."""
        try:
            if block:
                self._busy_since = None  # waiting for work is not being stuck
                command = self._commands.get()
                self._busy_since = time.monotonic()
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Shutdown):
                return False
            if isinstance(command, _AddRequest):
                self._add_request(command)
            elif isinstance(command, _Call):
                command.run()
            else:
                self.llm_engine.abort_request(command.request_ids)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add_request(self, command: _AddRequest) -> None:
        """Queue a request in the engine; a rejected one gets its error, the engine carries on."""
        with self._lock:
            wanted = command.request_id in self._streams
        if not wanted:  # its consumer already left
            return
        try:
            self.llm_engine.add_request(
                command.request_id, command.prompt, command.params,
                priority=command.priority, arrival_time=command.arrival_time, lora_request=command.lora_request,
            )
        except Exception as exc:  # noqa: BLE001 - delivered to the one request it concerns
            self._deliver([(command.request_id, exc)])

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._deliver([(out.request_id, out) for out in outputs])

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams: one call_soon_threadsafe per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:  # none: aborted or its consumer left meanwhile
                    by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed; nobody is listening there any more
                logger.debug("dropped %d outputs for a closed event loop", len(batch))

    def _fail_all(self, error: EngineDeadError, cause: BaseException | None) -> None:
        error.__cause__ = cause
        with self._lock:
            self._dead_error = error
            request_ids = list(self._streams)
            calls = self._take_queued_calls()
        self._deliver([(rid, error) for rid in request_ids])
        for call in calls:
            call.future.set_exception(error)

    def _take_queued_calls(self) -> list[_Call]:
        """Empty the command queue (the thread is leaving its loop) and return the calls in it."""
        calls = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return calls
            if isinstance(command, _Call):
                calls.append(command)

    def _shutdown_workers(self) -> None:
        try:
            self.llm_engine.shutdown()
        except Exception:  # noqa: BLE001 - shutting down after a failure must not hide the failure
            logger.exception("shutting down the workers failed")


async def _final(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The last output of a request (its generator closed, so nothing is left in the engine)."""
    async for last in outputs:
        pass
    return last


def _put_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream.put(item)
