"""POST /v1/chat/completions: the conversation through the chat template, answered whole or streamed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from llmplug.core.outputs import CompletionOutput, RequestOutput
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
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


class OpenAIServingChat(OpenAIServing):
    """Chat completions."""

    async def create(self, body: ChatCompletionRequest, raw_request: Request) -> Response:
        """Answer one chat completion request."""
        model = self.check_model(body.model)
        _check_supported(body)
        template_kwargs = {"add_generation_prompt": body.add_generation_prompt}
        if body.continue_final_message:
            template_kwargs.update(continue_final_message=True, add_generation_prompt=False)
        prompt_text, prompt_ids = await self.renderer.render_chat(chat_messages(body.messages), template_kwargs,
                                                                  body.chat_template_kwargs)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt_ids), param, "messages")
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = self.sampling_params(body, max_tokens, top_logprobs, body.stream)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = self.generate(prompt_text, prompt_ids, params, request_id)
        if body.stream:
            # wait for the first output here, so an error the engine finds gets its status code
            first = await until_disconnected(raw_request, anext(outputs))
            stream = self._stream(first, outputs, request_id, model, body, len(prompt_ids))
            return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        final = await until_disconnected(raw_request, last_output(outputs))
        response = ChatCompletionResponse(
            id=request_id, model=model, created=now(),
            choices=[_choice(c, top_logprobs) for c in sorted(final.outputs, key=lambda c: c.index)],
            usage=usage_info(len(prompt_ids), sum(len(c.token_ids) for c in final.outputs), final.num_cached_tokens),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def _stream(self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None], request_id: str,
                      model: str, body: ChatCompletionRequest, num_prompt_tokens: int) -> AsyncIterator[str]:
        """The chunks: a role chunk per choice, content deltas, finish reasons, usage, then [DONE]."""
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = include_usage and options.continuous_usage_stats
        top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        created = now()
        num_generated = [0] * body.n
        cached = first.num_cached_tokens

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            message = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                   usage=usage)
            return sse(message.model_dump_json(exclude=None if include_usage else {"usage"}))

        try:
            for index in range(body.n):
                yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
            output: RequestOutput | None = first
            while output is not None:
                for completion in output.outputs:
                    num_generated[completion.index] += len(completion.token_ids)
                    choice = _stream_choice(completion, top_logprobs)
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
    if body.tools and body.tool_choice != "none":
        raise OpenAIError(400, "tool calling is not supported by this server", param="tools")
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")




def _logprobs(completion: CompletionOutput, top_logprobs: int | None) -> ChatChoiceLogprobs | None:
    if top_logprobs is None or completion.logprobs is None:
        return None
    return ChatChoiceLogprobs(content=chat_logprobs(completion.token_ids, completion.logprobs, top_logprobs))


def _choice(completion: CompletionOutput, top_logprobs: int | None) -> ChatCompletionChoice:
    return ChatCompletionChoice(
        index=completion.index,
        message=ChatResponseMessage(content=completion.text),
        logprobs=_logprobs(completion, top_logprobs),
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )


def _stream_choice(completion: CompletionOutput, top_logprobs: int | None) -> ChatCompletionStreamChoice | None:
    """The chunk of one completion's delta, or None when it adds nothing."""
    logprobs = _logprobs(completion, top_logprobs)
    if not completion.text and completion.finish_reason is None and not (logprobs and logprobs.content):
        return None
    return ChatCompletionStreamChoice(
        index=completion.index,
        delta=DeltaMessage(content=completion.text) if completion.text else DeltaMessage(),
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )
