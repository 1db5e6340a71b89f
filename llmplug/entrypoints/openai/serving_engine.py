"""What every endpoint handler shares: model check, prompts to token ids, sampling params, generation with
metrics, server-sent events and awaiting work that a client disconnect cancels."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request

from llmplug.core.errors import EngineDeadError, EngineStateError, InvalidRequestError
from llmplug.core.outputs import PositionLogprobs, RequestOutput
from llmplug.core.params import BeamSearchParams, RequestOutputKind, SamplingParams
from llmplug.engine.async_llm import AsyncLLM
from llmplug.lora.request import LoRARequest
from llmplug.entrypoints.openai.admission import AdmissionControl
from llmplug.entrypoints.openai.errors import OpenAIError, error_body
from llmplug.entrypoints.openai.guided import guided_decoding_params
from llmplug.entrypoints.openai.image_inputs import ImageInputs, is_media_part
from llmplug.entrypoints.openai.loggable import loggable_list
from llmplug.entrypoints.openai.metrics import ServerMetrics
from llmplug.entrypoints.openai.prompt_renderer import PromptRenderer
from llmplug.entrypoints.openai.request_caps import check_request_caps
from llmplug.entrypoints.openai.serving_lora import ServedAdapters
from llmplug.entrypoints.openai.protocol import (
    ChatLogprob,
    ChatMessage,
    ChatTopLogprob,
    OpenAIModel,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
    ignored_fields,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# OpenAI's default sampling values where a request leaves a field out.
DEFAULT_TEMPERATURE = 1.0
# Sampling fields a beam search does not apply (it ranks whole beams by their logprobs and samples only through
# `temperature`; its text skips special tokens), each with the values that leave it off: any other value is a
# 400 naming the field rather than an answer that ignored it.
_BEAM_SEARCH_NEUTRAL = {
    "top_p": (None, 1.0), "top_k": (None, -1, 0), "min_p": (None, 0.0), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "logit_bias": (None, {}),
    "stop_token_ids": (None, []), "bad_words": (None, []), "allowed_token_ids": (None,), "min_tokens": (0,),
    "skip_special_tokens": (True,),
}


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


class OpenAIServing:
    """The parts of serving an OpenAI endpoint that do not depend on the endpoint."""

    def __init__(self, engine: AsyncLLM, model_names: list[str], metrics: ServerMetrics, renderer: PromptRenderer,
                 admission: AdmissionControl, adapters: ServedAdapters | None = None):
        self.engine = engine
        self.model_names = model_names
        self.adapters = adapters or ServedAdapters(engine, model_names)
        self.metrics = metrics
        self.renderer = renderer  # chat template and tokenization, off the event loop
        self.admission = admission
        self.max_model_len = engine.max_model_len

    # --- request checks ----------------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The model name to answer with; 404 for a model (or LoRA adapter) this server does not serve."""
        if model is None or model == "":
            return self.model_names[0]
        if model not in self.model_names and self.adapters.get(model) is None:
            served = [*self.model_names, *self.adapters.by_name]
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"{', '.join(served)}.", param="model", code="model_not_found")
        return model

    async def resolve_model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """The model name to answer with and the LoRA adapter it names (None: the base model); 404 when unknown."""
        lora = await self.adapters.resolve(model) if model else None
        return self.check_model(model), lora

    def check_caps(self, body: OpenAIModel) -> None:
        """A 400 when the request asks for more than a cap allows (prompts, inputs, token-id lists, tools, ...),
        or for a priority the scheduler would ignore: the first check of every handler, before any work per item."""
        check_request_caps(body, self.engine.config.decoding)
        self.check_priority(body)

    def check_priority(self, body: OpenAIModel) -> None:
        """400 for a non-zero `priority` (vLLM's field) when the scheduler serves in arrival order: it would be
        ignored. Under scheduler.policy "priority" it orders the waiting requests (lower first)."""
        priority = body.priority if "priority" in type(body).model_fields else 0
        if priority and self.engine.config.scheduler.policy != "priority":
            raise OpenAIError(400, f"priority is {priority}, but this server schedules first come, first served "
                                   "(scheduler.policy \"fcfs\"); send priority 0, or start the server with "
                                   "--scheduling-policy priority", param="priority")

    def check_prompt_length(self, num_prompt_tokens: int, param: str) -> None:
        """400 when the prompt leaves no room to generate a token."""
        if num_prompt_tokens >= self.max_model_len:
            raise OpenAIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                     f"{num_prompt_tokens} tokens; shorten it to leave room for at least one generated token.",
                param=param, code="context_length_exceeded")

    def max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str, prompt_param: str) -> int:
        """The tokens to generate: as asked (400 beyond the context), or all the room left when not given."""
        self.check_prompt_length(num_prompt_tokens, prompt_param)
        room = self.max_model_len - num_prompt_tokens
        if requested is None:
            return room
        if requested > room:
            raise OpenAIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                     f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for "
                     f"the completion). Reduce the prompt or `{param}`.", param=param, code="context_length_exceeded")
        return requested

    def sampling_params(self, request: SamplingRequest, max_tokens: int, logprobs: int | None,
                        stream: bool, **overrides: Any) -> SamplingParams:
        """SamplingParams of a request; `overrides` replace fields the request's own would set."""
        return make_sampling_params(
            request, max_tokens=max_tokens, logprobs=logprobs, stream=stream,
            vocab_size=self.engine.vocab_size, **overrides,
        )

    def beam_search_params(self, request: SamplingRequest, params: SamplingParams,
                           lora: LoRARequest | None = None) -> BeamSearchParams | None:
        """BeamSearchParams when the request asks for beam search (`n` beams); 400 for what it cannot combine with."""
        if not request.use_beam_search:
            return None
        refused = {"stop": params.stop, "logprobs": params.logprobs is not None,
                   "response_format": params.guided_decoding is not None}
        for name, given in refused.items():
            if given:
                raise OpenAIError(400, f"use_beam_search cannot be combined with {name}: beam search ranks whole "
                                       "beams by their logprobs and returns no per-token logprobs, stop strings "
                                       "or grammars", param=name)
        ignored = [name for name, neutral in _BEAM_SEARCH_NEUTRAL.items() if getattr(request, name) not in neutral]
        if request.seed is not None and request.temperature:  # its one sampled candidate per beam is not seeded
            ignored.append("seed")
        if ignored:
            raise OpenAIError(400, f"use_beam_search cannot be combined with {', '.join(ignored)}: beam search ranks "
                                   "whole beams by their logprobs, sampling only through temperature, and would "
                                   "ignore it", param=ignored[0])
        if request.priority:
            raise OpenAIError(400, "use_beam_search cannot be combined with priority: the beams' steps are queued "
                                   "as requests of their own, at the default priority", param="priority")
        if lora is not None:
            raise OpenAIError(400, f"use_beam_search cannot be combined with a LoRA adapter (model "
                                   f"{lora.lora_name!r}): beam search runs on the base model only", param="model")
        try:
            return BeamSearchParams(
                beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                temperature=request.temperature or 0.0, length_penalty=request.length_penalty,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        except InvalidRequestError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from exc

    async def admitted(self, outputs: AsyncGenerator[T, None], num_sequences: int) -> AsyncGenerator[T, None]:
        """`outputs` of a request of several prompts, admitted as a whole: its `num_sequences` are counted (a 503
        at the first output when they do not fit) until they end."""
        with self.admission.admit(num_sequences):
            try:
                async for item in outputs:
                    yield item
            finally:
                await outputs.aclose()

    def log_ignored_fields(self, body: OpenAIModel, endpoint: str) -> None:
        """Log the request fields this server does not know: they are ignored, as vLLM ignores them. The
        names are the client's text: logged escaped, cut short and at most MAX_ITEMS of them."""
        ignored = ignored_fields(body)
        if ignored:
            logger.warning("%s: these request fields are not known to this server and are ignored: %s",
                           endpoint, loggable_list(ignored))

    # --- generation --------------------------------------------------------------------------

    async def generate(self, prompt_text: str | None, prompt_ids: list[int], params: SamplingParams,
                       request_id: str, lora: LoRARequest | None = None,
                       beam: BeamSearchParams | None = None, admit: bool = True, priority: int = 0,
                       prompt_embeds: Any = None, mm_data: dict[str, list[Any]] | None = None,
                       mm_processor_kwargs: dict[str, Any] | None = None,
                       ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs of one request, recorded in the metrics however the request ends.

        `priority` orders it among the waiting requests under scheduler.policy "priority" (`check_priority`).
        `prompt_embeds` (a checked tensor) replaces the prompt: `prompt_ids` are then its placeholders.
        `mm_data` (loaded PIL images or audio clips of each modality, in the prompt's order) goes with the prompt as
        `multi_modal_data` with the rendered `prompt_text` (its special tokens the template's): the model's processor
        expands their placeholders, so `prompt_ids` are then the unexpanded ones; `mm_processor_kwargs` (the request's) go to the model's processor with them.

        With `beam`, the request is a beam search: one finished output whose completions are the best beams.

        503 at once when too many requests wait for the running batch already (admission control). When a
        failure inside the engine aborted a completion (its `error` is set), the outputs still all come (the
        last with finish_reason "abort"), then a 500 OpenAIError carrying the engine's reason: a stream
        reports it as an error event, a whole answer as its error body.
        """
        with self.admission.admit(params.n) if admit else contextlib.nullcontext():  # else: the caller admitted
            tracker = self.metrics.track(len(prompt_ids), params, request_id)
            if self.metrics.request_logger is not None:
                self.metrics.request_logger.log(request_id, prompt_text, prompt_ids, params, lora)
            delta = params.output_kind == RequestOutputKind.DELTA
            prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_ids} if prompt_embeds is None else {
                "prompt_embeds": prompt_embeds}
            if mm_data:  # the rendered chat goes through the model's processor, which expands each placeholder
                prompt = {"prompt": prompt_text, "multi_modal_data": mm_data, "mm_processor_kwargs": mm_processor_kwargs,
                          "add_special_tokens": False}
            outcome = "abort"  # unless it finishes or fails: the consumer went away
            if beam is None:
                outputs = self.engine.generate(prompt, params, request_id, priority=priority, lora_request=lora)
            else:
                outputs = self.engine.beam_search(prompt, beam, request_id)
            failure = None
            try:
                async for output in outputs:
                    tracker.observe(output, delta)
                    failure = failure or next((c.error for c in output.outputs if c.error is not None), None)
                    yield output
                if failure is not None:
                    raise OpenAIError(500, f"The request failed inside the engine: {failure}", code="request_failed")
                outcome = None
            except Exception:
                outcome = "error"
                raise
            finally:
                await outputs.aclose()  # now, not at garbage collection: aborts an unfinished request at once
                if outcome is not None:
                    tracker.finish(outcome)


def make_sampling_params(request: Any, *, max_tokens: int, logprobs: int | None, stream: bool,
                         vocab_size: int, **overrides: Any) -> SamplingParams:
    """SamplingParams from the fields of an OpenAI request (absent fields take OpenAI's defaults), with
    `overrides` in place of what the request's fields would set."""
    fields = type(request).model_fields  # not the unknown extras a client may send

    def value(name: str, default: Any) -> Any:
        got = getattr(request, name) if name in fields else None
        return default if got is None else got

    if "guided_decoding" not in overrides:
        overrides["guided_decoding"] = guided_decoding_params(request)
    try:
        return SamplingParams(**{**dict(
            n=value("n", 1),
            temperature=value("temperature", DEFAULT_TEMPERATURE),
            top_p=value("top_p", 1.0),
            top_k=value("top_k", None),
            min_p=value("min_p", 0.0),
            presence_penalty=value("presence_penalty", 0.0),
            frequency_penalty=value("frequency_penalty", 0.0),
            repetition_penalty=value("repetition_penalty", 1.0),
            logit_bias=logit_bias(value("logit_bias", None), vocab_size),
            seed=value("seed", None),
            stop=value("stop", None),
            stop_token_ids=value("stop_token_ids", None),
            bad_words=value("bad_words", None),
            allowed_token_ids=value("allowed_token_ids", None),
            include_stop_str_in_output=value("include_stop_str_in_output", False),
            ignore_eos=value("ignore_eos", False),
            min_tokens=value("min_tokens", 0),
            max_tokens=max_tokens,
            logprobs=logprobs,
            skip_special_tokens=value("skip_special_tokens", True),
            spaces_between_special_tokens=value("spaces_between_special_tokens", True),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        ), **overrides})
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc), param=exc.param) from exc


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token id as text -> bias in [-100, 100]) as SamplingParams wants it."""
    if not bias:
        return None
    result = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise OpenAIError(400, f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise OpenAIError(400, f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise OpenAIError(400, f"logit_bias value {value} for token {token_id} is outside [-100, 100]",
                              param="logit_bias")
        result[token_id] = float(value)
    return result


def message_text(content: Any, param: str) -> str:
    """The text of a message's content: a string, or text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if is_media_part(part):  # the routes that take images and audio read them first (message_content)
            raise OpenAIError(400, f"image and audio content is not accepted here; got a part of type "
                                   f"{part.type!r}", param=param)
        if part.type not in ("text", "input_text", "output_text") or part.text is None:
            raise OpenAIError(400, f"only text, image and audio content is supported; got a part of type "
                                   f"{part.type!r}", param=param)
        texts.append(part.text)
    return "\n".join(texts)


def message_content(content: Any, param: str, images: ImageInputs | None) -> str | list[dict[str, str]]:
    """A message's content as the chat template takes it: its text, or, when it holds images or audio (recorded in
    `images`; None: a route that takes none), its text and `{"type": "image"}` / `{"type": "audio"}` parts in
    order."""
    if content is None or isinstance(content, str) or images is None or not any(map(is_media_part, content)):
        return message_text(content, param)
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        if is_media_part(part):
            parts.append(images.add(part, f"{param}[{j}]", param))
        else:
            parts.append({"type": "text", "text": message_text([part], param)})
    return parts


def chat_messages(messages: list[ChatMessage], images: ImageInputs | None = None) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (`developer` is the template's `system`); image parts are
    recorded in `images` (None: refused, as on /tokenize)."""
    rendered = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role,
            "content": message_content(message.content, f"messages[{i}].content", images),
        }
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump(include={"id", "type", "function"}) for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered


async def last_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The final output of a request (its only one, with FINAL_ONLY)."""
    last = None
    async for output in outputs:
        last = output
    assert last is not None, "the engine ends every request with a final output"
    return last


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    """The `usage` of chat and completions answers."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# --- logprobs -------------------------------------------------------------------------------------


def token_bytes(text: str | None) -> list[int] | None:
    return list(text.encode("utf-8")) if text is not None else None


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top_k: int) -> list[ChatLogprob]:
    """Per generated token: its text, logprob and bytes, and the `top_k` most likely alternatives."""
    entries = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) or next(iter(position.values()))
        top = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top_k),
                     key=lambda lp: lp.rank)
        entries.append(ChatLogprob(
            token=chosen.decoded_token or "", logprob=finite(chosen.logprob), bytes=token_bytes(chosen.decoded_token),
            top_logprobs=[ChatTopLogprob(token=lp.decoded_token or "", logprob=finite(lp.logprob),
                                         bytes=token_bytes(lp.decoded_token)) for lp in top[:top_k]],
        ))
    return entries


def finite(value: float) -> float:
    """JSON has no -inf: clamp to the most negative float, as vLLM does."""
    return max(value, -9999.0)


# --- streaming ------------------------------------------------------------------------------------

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no buffering by proxies


def sse(data: str, event: str | None = None) -> str:
    """One server-sent event."""
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error in the middle of a stream, as an event whose data is the OpenAI error body."""
    if isinstance(exc, OpenAIError):
        return sse(json.dumps(error_body(exc.status, exc.message, exc.param, exc.code)))
    status, message = error_status(exc)
    return sse(json.dumps(error_body(status, message)))


def error_status(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and message an exception maps to."""
    if isinstance(exc, OpenAIError):
        return exc.status, exc.message
    if isinstance(exc, InvalidRequestError):
        return 400, str(exc)
    if isinstance(exc, (EngineDeadError, EngineStateError)):  # dead, or asleep (/sleep)
        return 503, str(exc)
    logger.error("unexpected error while streaming", exc_info=exc)
    return 500, "The server had an error while processing the request."


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`; if the client disconnects first, cancel it and raise ClientDisconnected.

    Starlette cancels a streaming response when its client leaves, but not a handler that is still
    working on its answer: this is how a non-streaming request's generation is stopped early.
    """
    work = asyncio.ensure_future(awaitable)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await work
    if work in done:
        return work.result()
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge(streams: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async iterators as they come, tagged with the iterator's index.

    Closing the merged iterator (or an error in one stream) cancels every stream, which aborts their
    requests.
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    # bounded: behind a slow consumer the pumps wait, and each request's engine stream merges its outputs
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, done))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, who raises it
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def now() -> int:
    """Unix time in seconds, for `created` fields."""
    return int(time.time())
