"""POST /v1/responses: OpenAI's Responses API for text and function tools (input string or items,
instructions, streaming events).

Function tools work as in chat (see tools.py): calls come back as `function_call` output items, and their
results go in as `function_call_output` input items. With a reasoning parser the reasoning is a
`reasoning` output item before the answer. Nothing is stored: `previous_response_id` is refused with 400.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from llmplug.core.outputs import CompletionOutput, RequestOutput
from llmplug.entrypoints.openai.backpressure import EventStreamResponse
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.image_inputs import ImageInputs
from llmplug.entrypoints.openai.protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesFunctionCall,
    ResponsesFunctionCallOutput,
    ResponsesLogprob,
    ResponsesNamedToolChoice,
    ResponsesRequest,
    ResponsesTopLogprob,
    ResponseUsage,
)
from llmplug.entrypoints.openai.reply import ReplyDelta, ReplyReader, call_id
from llmplug.entrypoints.openai.serving_chat import OpenAIServingChat
from llmplug.entrypoints.openai.serving_engine import (
    SSE_HEADERS,
    chat_logprobs,
    error_status,
    last_output,
    message_content,
    sse,
    until_disconnected,
)
from llmplug.entrypoints.openai.tools import template_input, tool_choice


class OpenAIServingResponses(OpenAIServingChat):
    """The Responses API (a chat server underneath: same template, tools and parsers)."""

    async def create(self, body: ResponsesRequest, raw_request: Request) -> Response:
        """Answer one responses request."""
        model, lora = await self.resolve_model(body.model)
        self.check_caps(body)
        self.log_ignored_fields(body, "/v1/responses")
        _check_supported(body)
        named = body.tool_choice.name if isinstance(body.tool_choice, ResponsesNamedToolChoice) else None
        choice = tool_choice(body.tools, None if named else body.tool_choice, named, body.parallel_tool_calls,
                             self.parsers.auto_tool_choice)
        hint = self.parsers.tool_parser.format_hint if self.parsers.tool_parser else ""
        images = ImageInputs()
        rendered = _messages(body, images)
        self.image_loader.check(images)
        messages, tool_kwargs = template_input(rendered, choice, self.template_takes_tools, hint)
        template_kwargs = {**tool_kwargs, "add_generation_prompt": True}
        prompt_text, prompt_ids = await self.renderer.render_chat(messages, template_kwargs,
                                                                  has_images=bool(images.refs))
        max_tokens = self.max_tokens(body.max_output_tokens, len(prompt_ids), "max_output_tokens", "input")
        pictures = await self.image_loader.load(images)
        if pictures:  # the processor's expansion adds tokens: the engine gives what room is left (or a 400)
            max_tokens = body.max_output_tokens
        reader, overrides = self.reply_plan(body, choice, prompt_text)
        params = self.sampling_params(body, max_tokens, body.top_logprobs, body.stream, **overrides)
        response_id = f"resp_{uuid.uuid4().hex}"
        outputs = self.generate(prompt_text, prompt_ids, params, response_id, lora, priority=body.priority,
                                mm_data=pictures)
        builder = _ResponseBuilder(response_id, model, body, len(prompt_ids), reader)
        if body.stream:
            first = await until_disconnected(raw_request, anext(outputs))
            if pictures:  # the prompt the engine runs holds their placeholders
                builder.num_prompt_tokens = len(first.prompt_token_ids)
            return EventStreamResponse(builder.events(first, outputs), headers=SSE_HEADERS)
        final = await until_disconnected(raw_request, last_output(outputs))
        if pictures:
            builder.num_prompt_tokens = len(final.prompt_token_ids)
        completion = final.outputs[0]
        builder.add_tokens(completion, final.num_cached_tokens)
        builder.add_whole(completion.text)
        return Response(builder.response(completion.finish_reason).model_dump_json(), media_type="application/json")


def _check_supported(body: ResponsesRequest) -> None:
    if body.store:  # OpenAI's default is true, but a client that leaves it out sends nothing: None here
        raise OpenAIError(400, "store true is not supported: this server stores no responses (vLLM stores none "
                               "unless told to); send store false or leave it out", param="store")
    if body.previous_response_id is not None:
        raise OpenAIError(400, "previous_response_id is not supported: this server stores no responses; "
                               "send the whole conversation as input", param="previous_response_id")


def _messages(body: ResponsesRequest, images: ImageInputs) -> list[dict[str, Any]]:
    """`instructions` as the system message, then the input: user text, or messages (their images recorded in
    `images`), calls and call results."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        if isinstance(item, ResponsesFunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # the calls of one turn are one assistant message
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, ResponsesFunctionCallOutput):
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
        else:
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": message_content(item.content, f"input[{i}].content", images)})
    if not messages:
        raise OpenAIError(400, "input must not be empty", param="input")
    return messages


@dataclass
class _Item:
    """An output item being built: a reasoning item, the message, or a function call."""

    kind: str  # "reasoning", "message" or "function_call"
    id: str
    text: str = ""  # reasoning or message text; a call's arguments
    name: str = ""  # a call's function
    call_id: str = ""
    closed: bool = False  # its done events are sent


class _ResponseBuilder:
    """Builds the response object and its stream of events from the engine's outputs."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest, num_prompt_tokens: int,
                 reader: ReplyReader):
        self.response_id = response_id
        self.model = model
        self.body = body
        self.reader = reader
        self.created_at = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_tokens = 0
        self.items: list[_Item] = []
        self.calls: dict[int, _Item] = {}  # the parser's call index -> its item
        self.logprobs: list[ResponsesLogprob] | None = [] if body.top_logprobs is not None else None
        self.sequence_number = 0

    def add_tokens(self, completion: CompletionOutput, num_cached_tokens: int) -> list[ResponsesLogprob]:
        """Count a completion's new tokens; returns their logprobs."""
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

    def add_whole(self, text: str) -> None:
        """The items of a whole answer: reasoning, message, calls."""
        reply = self.reader.whole(text)
        if reply.reasoning:
            self.items.append(_Item("reasoning", f"rs_{uuid.uuid4().hex}", reply.reasoning))
        if reply.content or not (reply.tool_calls or reply.reasoning):  # as streamed: a message when there is text
            self.items.append(_Item("message", f"msg_{uuid.uuid4().hex}", reply.content or ""))
        for call in reply.tool_calls:
            self.items.append(_Item("function_call", f"fc_{uuid.uuid4().hex}", call.arguments, call.name, call_id()))

    def item(self, item: _Item, status: str) -> ReasoningItem | OutputMessage | ResponsesFunctionCall:
        """The output item as the API shows it."""
        if item.kind == "reasoning":
            return ReasoningItem(id=item.id, content=[ReasoningText(text=item.text)], status=status)
        if item.kind == "function_call":
            return ResponsesFunctionCall(id=item.id, call_id=item.call_id, name=item.name, arguments=item.text,
                                         status=status)
        content = [] if status == "in_progress" else [OutputText(text=item.text, logprobs=self.logprobs)]
        return OutputMessage(id=item.id, status=status, content=content)

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
            output=[] if status == "in_progress" else [self.item(item, status) for item in self.items],
            temperature=body.temperature if body.temperature is not None else 1.0,
            top_p=body.top_p if body.top_p is not None else 1.0,
            tool_choice=body.tool_choice or ("auto" if body.tools else "none"), tools=body.tools or [],
            parallel_tool_calls=body.parallel_tool_calls, metadata=body.metadata, usage=usage,
        )

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event of the Responses stream, numbered."""
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse(json.dumps(data), event=kind)

    async def events(self, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[str]:
        """created, in_progress, then per output item its added, delta and done events, completed/incomplete."""
        stream = self.reader.stream()
        try:
            started = self.response(None).model_dump()
            yield self.event("response.created", response=started)
            yield self.event("response.in_progress", response=started)
            output: RequestOutput | None = first
            finish_reason = None
            while output is not None:
                completion = output.outputs[0]
                new_logprobs = self.add_tokens(completion, output.num_cached_tokens)
                delta = stream.feed(completion.text)
                if completion.finish_reason is not None:
                    delta = delta.extend(stream.finish())
                for event in self._delta_events(delta, new_logprobs):
                    yield event
                finish_reason = completion.finish_reason or finish_reason
                output = await anext(outputs, None)
            if not self.items:  # an empty answer is still a message
                for event in self._open("message", f"msg_{uuid.uuid4().hex}"):
                    yield event
            status = self.response(finish_reason or "stop").status
            for event in self._close(status):
                yield event
            final = self.response(finish_reason or "stop")
            kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
            yield self.event(kind, response=final.model_dump())
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
            status, text = error_status(exc)
            yield self.event("error", code=str(status), message=text, param=None)
        finally:
            await outputs.aclose()

    def _delta_events(self, delta: ReplyDelta, logprobs: list[ResponsesLogprob]) -> list[str]:
        """The events of one delta: items opened (and the one before closed) as the answer moves on."""
        events = []
        if delta.reasoning:
            events += self._current("reasoning")
            ids = self._ids(self.items[-1])
            self.items[-1].text += delta.reasoning
            events.append(self.event("response.reasoning_text.delta", **ids, delta=delta.reasoning))
        if delta.content:
            events += self._current("message")
            self.items[-1].text += delta.content
            events.append(self.event("response.output_text.delta", **self._ids(self.items[-1]), delta=delta.content,
                                     logprobs=[lp.model_dump() for lp in logprobs]))
        for new_id, call in delta.tool_calls:
            if new_id is not None:
                events += self._close("completed") + self._open("function_call", f"fc_{uuid.uuid4().hex}",
                                                                 name=call.name, call_id=new_id)
                self.calls[call.index] = self.items[-1]
            item = self.calls[call.index]
            if call.arguments:
                item.text += call.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                         output_index=self.items.index(item), delta=call.arguments))
        return events

    def _ids(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item), "content_index": 0}

    def _current(self, kind: str) -> list[str]:
        """Events that make an open item of `kind` the last one (closing the one before)."""
        if self.items and self.items[-1].kind == kind and not self.items[-1].closed:
            return []
        prefix = "rs" if kind == "reasoning" else "msg"
        return self._close("completed") + self._open(kind, f"{prefix}_{uuid.uuid4().hex}")

    def _open(self, kind: str, item_id: str, **fields: Any) -> list[str]:
        item = _Item(kind, item_id, **fields)
        self.items.append(item)
        events = [self.event("response.output_item.added", output_index=len(self.items) - 1,
                             item=self.item(item, "in_progress").model_dump())]
        if kind == "message":
            events.append(self.event("response.content_part.added", **self._ids(item),
                                     part=OutputText(text="").model_dump()))
        return events

    def _close(self, status: str) -> list[str]:
        """The done events of the last item, if it is open."""
        if not self.items or self.items[-1].closed:
            return []
        item = self.items[-1]
        item.closed = True
        done = self.item(item, status).model_dump()
        if item.kind == "reasoning":
            events = [self.event("response.reasoning_text.done", **self._ids(item), text=item.text)]
        elif item.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", item_id=item.id,
                                 output_index=self.items.index(item), name=item.name, arguments=item.text)]
        else:
            events = [self.event("response.output_text.done", **self._ids(item), text=item.text,
                                 logprobs=[lp.model_dump() for lp in self.logprobs or []]),
                      self.event("response.content_part.done", **self._ids(item), part=done["content"][0])]
        return events + [self.event("response.output_item.done", output_index=self.items.index(item), item=done)]
