"""POST /v1/chat/completions: the conversation through the chat template, answered whole or streamed.

With tools the answer may hold tool calls (see tools.py), and with a reasoning parser its reasoning comes
apart from its content (`reasoning_content`); reply.py reads both out of the generated text.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from llmplug.core.outputs import CompletionOutput, RequestOutput
from llmplug.engine.async_llm import AsyncLLM
from llmplug.entrypoints.openai.admission import AdmissionControl
from llmplug.entrypoints.openai.backpressure import EventStreamResponse
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.guided import guided_decoding_params
from llmplug.entrypoints.openai.image_inputs import ImageInputs, ImageLoader
from llmplug.entrypoints.openai.metrics import ServerMetrics
from llmplug.entrypoints.openai.prompt_renderer import PromptRenderer
from llmplug.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    UsageInfo,
)
from llmplug.entrypoints.openai.reply import Reply, ReplyDelta, ReplyParsers, ReplyReader, ReplyStream, call_id
from llmplug.entrypoints.openai.tools import (
    ToolChoice,
    forced_call_constraint,
    reply_tool_parser,
    template_input,
    template_takes_tools,
    tool_choice,
)
from llmplug.entrypoints.openai.serving_engine import (
    SSE_HEADERS,
    OpenAIServing,
    chat_logprobs,
    chat_messages,
    last_output,
    now,
    sse,
    sse_error,
    until_disconnected,
    usage_info,
)
from llmplug.entrypoints.openai.serving_completion import (
    check_prompt_logprobs,
    check_sampling_fields,
    format_prompt_logprobs,
)
from llmplug.entrypoints.openai.serving_lora import ServedAdapters
from llmplug.entrypoints.openai.stream_chunks import TextChunks


class OpenAIServingChat(OpenAIServing):
    """Chat completions."""

    def __init__(self, engine: AsyncLLM, model_names: list[str], metrics: ServerMetrics, renderer: PromptRenderer,
                 admission: AdmissionControl, parsers: ReplyParsers | None = None,
                 adapters: ServedAdapters | None = None, image_loader: ImageLoader | None = None):
        super().__init__(engine, model_names, metrics, renderer, admission, adapters)
        self.parsers = parsers or ReplyParsers()
        # image parts: checked against the model, loaded under the server's media policy (default: data URLs only)
        self.image_loader = image_loader or ImageLoader.for_engine(engine, model_names[0])
        self.template_takes_tools = template_takes_tools(renderer.template_text())

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        """Answer one chat completion request."""
        model, lora = await self.resolve_model(body.model)
        self.check_caps(body)
        self.log_ignored_fields(body, "/v1/chat/completions")
        _check_supported(body)
        check_prompt_logprobs(body, self.engine)
        named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        choice = tool_choice([t.function for t in body.tools or ()], None if named else body.tool_choice, named,
                             body.parallel_tool_calls, self.parsers.auto_tool_choice)
        images = ImageInputs()
        prompt_text, prompt_ids = await self.render_prompt(body, choice, images)
        if body.use_beam_search and images.refs:  # before any image is read
            raise OpenAIError(400, "use_beam_search cannot be combined with images: the beams' steps are queued as "
                                   "prompts of token ids, without the images", param="use_beam_search")
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt_ids), param, "messages")
        pictures = await self.image_loader.load(images)
        if pictures:  # the processor's expansion adds tokens: the engine gives what room is left (or a 400)
            max_tokens = body.max_completion_tokens or body.max_tokens
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        reader, overrides = self.reply_plan(body, choice, prompt_text)
        params = self.sampling_params(body, max_tokens, top_logprobs, body.stream,
                                      prompt_logprobs=body.prompt_logprobs, **overrides)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        beam = self.beam_search_params(body, params, lora)
        outputs = self.generate(prompt_text, prompt_ids, params, request_id, lora, beam, priority=body.priority,
                                mm_data=pictures, mm_processor_kwargs=body.mm_processor_kwargs)
        if body.stream:
            # wait for the first output here, so an error the engine finds gets its status code
            first = await until_disconnected(raw_request, anext(outputs))
            num_prompt_tokens = len(first.prompt_token_ids) if pictures else len(prompt_ids)  # expanded by then
            stream = self._stream(first, outputs, request_id, model, body, num_prompt_tokens, reader)
            return EventStreamResponse(stream, headers=SSE_HEADERS)
        final = await until_disconnected(raw_request, last_output(outputs))
        num_prompt_tokens = len(final.prompt_token_ids) if pictures else len(prompt_ids)
        response = ChatCompletionResponse(
            id=request_id, model=model, created=now(),
            choices=[_choice(c, top_logprobs, reader) for c in sorted(final.outputs, key=lambda c: c.index)],
            usage=usage_info(num_prompt_tokens, sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens),
            prompt_logprobs=format_prompt_logprobs(final.prompt_logprobs, num_prompt_tokens, body.prompt_logprobs),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def render_prompt(self, body: Any, choice: ToolChoice | None,
                            images: ImageInputs | None = None) -> tuple[str, list[int]]:
        """The prompt: the messages (and tools) through the server's chat template, off the event loop. `body` is a
        chat request, or a /tokenize chat request (the same message and template fields). Image parts are recorded
        in `images` and checked against the model first (None: refused)."""
        hint = self.parsers.tool_parser.format_hint if self.parsers.tool_parser else ""
        rendered = chat_messages(body.messages, images)
        if images is not None:
            self.image_loader.check(images)
        messages, tool_kwargs = template_input(rendered, choice, self.template_takes_tools, hint)
        template_kwargs = {**tool_kwargs, "add_generation_prompt": body.add_generation_prompt}
        if body.continue_final_message:
            template_kwargs.update(continue_final_message=True, add_generation_prompt=False)
        return await self.renderer.render_chat(messages, template_kwargs, body.chat_template_kwargs,
                                               has_images=bool(images and images.refs))

    def reply_plan(self, body: Any, choice: ToolChoice | None, prompt_text: str) -> tuple[ReplyReader, dict[str, Any]]:
        """How the answers are read, and what that changes in the sampling: the grammar of a forced call (after
        the reasoning, when the answer starts with reasoning) and keeping the special tokens a format needs."""
        tool_parser = reply_tool_parser(choice, self.parsers.tool_parser)
        reader = self.parsers.reader(tool_parser, prompt_text, None if choice is None or choice.parallel else 1)
        forced = forced_call_constraint(choice) if choice else None
        overrides: dict[str, Any] = {
            "guided_decoding": guided_decoding_params(body, forced, self.parsers.grammar_start(reader)),
        }
        if tool_parser is not None and tool_parser.keep_special_tokens:
            overrides["skip_special_tokens"] = False
        return reader, overrides

    async def _stream(self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None], request_id: str,
                      model: str, body: ChatCompletionRequest, num_prompt_tokens: int,
                      reader: ReplyReader) -> AsyncIterator[str]:
        """The chunks: a role chunk per choice, content (reasoning, tool call) deltas, finish reasons, usage, [DONE]."""
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and options.continuous_usage_stats
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        created = now()
        num_generated = [0] * body.n
        streams = [reader.stream() for _ in range(body.n)]
        cached = first.num_cached_tokens

        def chunk_json(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            message = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                   usage=usage)
            return message.model_dump_json(exclude=None if include_usage else {"usage"})

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(chunk_json(choices, usage))

        # most chunks are one choice's next text and nothing else: those are filled into a template
        plain = reader.plain and top_logprobs is None and not continuous_usage
        text_chunks: dict[int, TextChunks] = {}

        def text_chunk(index: int, text: str) -> str:
            if index not in text_chunks:
                text_chunks[index] = TextChunks(lambda content: chunk_json(
                    [ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=content))]))
            return text_chunks[index](text)

        try:
            for index in range(body.n):
                yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            output: RequestOutput | None = first
            while output is not None:
                for completion in output.outputs:
                    num_generated[completion.index] += len(completion.token_ids)
                    if plain and completion.finish_reason is None and completion.stop_reason is None:
                        if completion.text:
                            yield text_chunk(completion.index, completion.text)
                        continue
                    choice = _stream_choice(completion, top_logprobs, streams[completion.index])
                    if choice is not None:
                        usage = usage_info(num_prompt_tokens, sum(num_generated), cached) if continuous_usage else None
                        yield chunk([choice], usage)
                output = await anext(outputs, None)
            if include_usage:
                yield chunk([], usage_info(num_prompt_tokens, sum(num_generated), cached))
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
            yield sse_error(exc)
        finally:
            await outputs.aclose()
        yield sse("[DONE]")


def _check_supported(body: ChatCompletionRequest) -> None:
    if "chat_template" in (body.model_extra or {}):
        raise OpenAIError(400, "chat_template is the server's (--chat-template); a request cannot set it",
                          param="chat_template")
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    check_sampling_fields(body)


def _logprobs(completion: CompletionOutput, top_logprobs: int | None) -> ChatChoiceLogprobs | None:
    if top_logprobs is None or completion.logprobs is None:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(completion.token_ids, completion.logprobs, top_logprobs))


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" when an answer that ended on its own made calls."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def _choice(completion: CompletionOutput, top_logprobs: int | None, reader: ReplyReader) -> ChatCompletionChoice:
    reply: Reply = reader.whole(completion.text)
    calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in reply.tool_calls]
    return ChatCompletionChoice(
        index=completion.index,
        message=ChatResponseMessage(content=reply.content, reasoning_content=reply.reasoning, tool_calls=calls or None),
        logprobs=_logprobs(completion, top_logprobs),
        finish_reason=finish_reason(completion.finish_reason, bool(calls)),
        stop_reason=completion.stop_reason,
    )


def _stream_choice(completion: CompletionOutput, top_logprobs: int | None,
                   stream: ReplyStream) -> ChatCompletionStreamChoice | None:
    """The chunk of one completion's delta, or None when it adds nothing."""
    delta: ReplyDelta = stream.feed(completion.text)
    if completion.finish_reason is not None:
        delta = delta.extend(stream.finish())
    logprobs = _logprobs(completion, top_logprobs)
    message = DeltaMessage(
        content=delta.content or None, reasoning_content=delta.reasoning or None,
        tool_calls=[DeltaToolCall(index=d.index, id=new_id, type="function" if new_id else None,
                                  function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
                    for new_id, d in delta.tool_calls] or None,
    )
    if message == DeltaMessage() and completion.finish_reason is None and not (logprobs and logprobs.content):
        return None
    return ChatCompletionStreamChoice(
        index=completion.index, delta=message, logprobs=logprobs,
        finish_reason=finish_reason(completion.finish_reason, stream.num_calls > 0),
        stop_reason=completion.stop_reason,
    )
