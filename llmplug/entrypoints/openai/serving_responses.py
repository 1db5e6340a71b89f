"""POST /v1/responses: OpenAI's Responses API for text (input string or messages, instructions, streaming events).

Nothing is stored: `previous_response_id` and tools are refused with 400.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from llmplug.core.outputs import CompletionOutput, RequestOutput
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesLogprob,
    ResponsesRequest,
    ResponsesTopLogprob,
    ResponseUsage,
)
from llmplug.entrypoints.openai.serving_engine import (
    SSE_HEADERS,
    OpenAIServing,
    chat_logprobs,
    error_status,
    last_output,
    message_text,
    sse,
    until_disconnected,
)


class OpenAIServingResponses(OpenAIServing):
    """The Responses API, text only."""

    async def create(self, body: ResponsesRequest, raw_request: Request) -> Response:
        """Answer one responses request."""
        model = self.check_model(body.model)
        _check_supported(body)
        prompt_text, prompt_ids = await self.renderer.render_chat(_messages(body), {"add_generation_prompt": True})
        max_tokens = self.max_tokens(body.max_output_tokens, len(prompt_ids), "max_output_tokens", "input")
        params = self.sampling_params(body, max_tokens, body.top_logprobs, body.stream)
        response_id = f"resp_{uuid.uuid4().hex}"
        outputs = self.generate(prompt_text, prompt_ids, params, response_id)
        builder = _ResponseBuilder(response_id, model, body, len(prompt_ids))
        if body.stream:
            first = await until_disconnected(raw_request, anext(outputs))
            return StreamingResponse(builder.events(first, outputs), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        final = await until_disconnected(raw_request, last_output(outputs))
        completion = final.outputs[0]
        builder.add(completion, final.num_cached_tokens)
        return Response(builder.response(completion.finish_reason).model_dump_json(), media_type="application/json")


def _check_supported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise OpenAIError(400, "previous_response_id is not supported: this server stores no responses; "
                               "send the whole conversation as input", param="previous_response_id")
    if body.tools:
        raise OpenAIError(400, "tools are not supported by this server", param="tools")


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` as the system message, then the input as user text or as messages."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        role = "system" if item.role == "developer" else item.role
        messages.append({"role": role, "content": message_text(item.content, f"input[{i}].content")})
    if not messages:
        raise OpenAIError(400, "input must not be empty", param="input")
    return messages



class _ResponseBuilder:
    """Builds the response object and its stream of events from the engine's outputs."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest, num_prompt_tokens: int):
        self.response_id = response_id
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.body = body
        self.created_at = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.text = ""
        self.num_tokens = 0
        self.logprobs: list[ResponsesLogprob] | None = [] if body.top_logprobs is not None else None
        self.sequence_number = 0

    def add(self, completion: CompletionOutput, num_cached_tokens: int) -> list[ResponsesLogprob]:
        """Fold in a completion's new text and tokens; returns the new tokens' logprobs."""
        self.text += completion.text
        self.num_tokens += len(completion.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, num_cached_tokens)
        if self.logprobs is None or completion.logprobs is None:
            return []
        new = [
            ResponsesLogprob(token=lp.token, logprob=lp.logprob, bytes=lp.bytes,
                             top_logprobs=[ResponsesTopLogprob(**t.model_dump()) for t in lp.top_logprobs])
            for lp in chat_logprobs(completion.token_ids, completion.logprobs, self.body.top_logprobs)
        ]
        self.logprobs += new
        return new

    def message(self, status: str) -> OutputMessage:
        content = [] if status == "in_progress" else [OutputText(text=self.text, logprobs=self.logprobs)]
        return OutputMessage(id=self.message_id, status=status, content=content)

    def response(self, finish_reason: str | None) -> ResponseObject:
        """The response object: in progress (finish_reason None), completed, or incomplete (length)."""
        status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
        body = self.body
        usage = None
        if status != "in_progress":
            usage = ResponseUsage(input_tokens=self.num_prompt_tokens, output_tokens=self.num_tokens,
                                  total_tokens=self.num_prompt_tokens + self.num_tokens,
                                  input_tokens_details=InputTokensDetails(cached_tokens=self.num_cached_tokens))
        return ResponseObject(
            id=self.response_id, created_at=self.created_at, status=status, model=self.model,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            output=[] if status == "in_progress" else [self.message(status)],
            temperature=body.temperature if body.temperature is not None else 1.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            metadata=body.metadata, usage=usage,
        )

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event of the Responses stream, numbered."""
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse(json.dumps(data), event=kind)

    async def events(self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[str]:
        """created, in_progress, item and part added, text deltas, the done events, completed/incomplete."""
        ids = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        try:
            started = self.response(None).model_dump()
            yield self.event("response.created", response=started)
            yield self.event("response.in_progress", response=started)
            yield self.event("response.output_item.added", output_index=0,
                             item=self.message("in_progress").model_dump())
            yield self.event("response.content_part.added", **ids, part=OutputText(text="").model_dump())
            output: RequestOutput | None = first
            finish_reason = None
            while output is not None:
                completion = output.outputs[0]
                new_logprobs = self.add(completion, output.num_cached_tokens)
                if completion.text:
                    yield self.event("response.output_text.delta", **ids, delta=completion.text,
                                     logprobs=[lp.model_dump() for lp in new_logprobs])
                finish_reason = completion.finish_reason or finish_reason
                output = await anext(outputs, None)
            final = self.response(finish_reason or "stop")
            message = final.output[0]
            yield self.event("response.output_text.done", **ids, text=self.text,
                             logprobs=[lp.model_dump() for lp in self.logprobs or []])
            yield self.event("response.content_part.done", **ids, part=message.content[0].model_dump())
            yield self.event("response.output_item.done", output_index=0, item=message.model_dump())
            kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
            yield self.event(kind, response=final.model_dump())
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
            status, text = error_status(exc)
            yield self.event("error", code=str(status), message=text, param=None)
        finally:
            await outputs.aclose()
