"""POST /v1/completions: one or many prompts (text or token ids) completed as they are."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from llmplug.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from llmplug.entrypoints.openai.backpressure import EventStreamResponse
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from llmplug.entrypoints.openai.serving_engine import (
    SSE_HEADERS,
    OpenAIServing,
    finite,
    merge,
    now,
    sse,
    sse_error,
    until_disconnected,
    usage_info,
)


@dataclass(slots=True)
class _Prompt:
    """One prompt of the request: its text (None when given as token ids) and token ids."""

    text: str | None
    token_ids: list[int]


@dataclass
class _ChoiceState:
    """What a streamed choice has sent so far: text length (for logprob offsets) and tokens."""

    text_offset: int = 0
    num_tokens: int = 0
    echoed: bool = False


@dataclass
class _RequestState:
    num_prompt_tokens: int = 0
    cached_tokens: int = 0
    choices: dict[int, _ChoiceState] = field(default_factory=dict)


class OpenAIServingCompletion(OpenAIServing):
    """Text completions."""

    async def create(self, body: CompletionRequest, raw_request: Request) -> Response:
        """Answer one completions request (n completions of each of its prompts)."""
        model, lora = await self.resolve_model(body.model)
        self.check_caps(body)
        self.log_ignored_fields(body, "/v1/completions")
        _check_supported(body)
        prompts = await self._prompts(body.prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = []
        for i, prompt in enumerate(prompts):
            max_tokens = self.max_tokens(body.max_tokens, len(prompt.token_ids), "max_tokens", "prompt")
            params = self.sampling_params(body, max_tokens, body.logprobs, body.stream)
            beam = self.beam_search_params(body, params, lora)
            streams.append(self.generate(prompt.text, prompt.token_ids, params, f"{request_id}-{i}", lora, beam,
                                         admit=False, priority=body.priority))
        outputs = self.admitted(merge(streams), body.n * len(prompts))  # every prompt's n sequences, at once
        if body.stream:
            first = await until_disconnected(raw_request, anext(outputs))
            stream = self._stream(first, outputs, request_id, model, body, prompts)
            return EventStreamResponse(stream, headers=SSE_HEADERS)
        finals = await until_disconnected(raw_request, _collect(outputs, len(prompts)))
        choices, num_generated, cached = [], 0, 0
        for i, (prompt, final) in enumerate(zip(prompts, finals)):
            cached += final.num_cached_tokens
            for completion in sorted(final.outputs, key=lambda c: c.index):
                num_generated += len(completion.token_ids)
                choices.append(self._choice(i * body.n + completion.index, prompt, completion, body))
        usage = usage_info(sum(len(p.token_ids) for p in prompts), num_generated, cached)
        response = CompletionResponse(id=request_id, created=now(), model=model, choices=choices, usage=usage)
        return Response(response.model_dump_json(), media_type="application/json")

    async def _prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[_Prompt]:
        """Every prompt of the request, tokenized as the offline engine does."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(_Prompt(item, await self.renderer.encode(item)))
            else:
                prompts.append(_Prompt(None, list(item)))
            if not prompts[-1].token_ids:
                raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return prompts

    def _prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.renderer.need_tokenizer().decode(prompt.token_ids)

    def _choice(self, index: int, prompt: _Prompt, completion: CompletionOutput,
                body: CompletionRequest) -> CompletionChoice:
        prefix = self._prompt_text(prompt) if body.echo else ""
        logprobs = None
        if body.logprobs is not None and completion.logprobs is not None:
            logprobs = _completion_logprobs(completion.token_ids, completion.logprobs, body.logprobs, len(prefix))
        return CompletionChoice(index=index, text=prefix + completion.text, logprobs=logprobs,
                                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)

    async def _stream(self, first: tuple[int, RequestOutput], outputs: AsyncGenerator[tuple[int, RequestOutput], None],
                      request_id: str, model: str, body: CompletionRequest,
                      prompts: list[_Prompt]) -> AsyncIterator[str]:
        """One chunk per new piece of text of any choice; usage; [DONE]."""
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        created = now()
        states = [_RequestState(num_prompt_tokens=len(p.token_ids)) for p in prompts]

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            message = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
            return sse(message.model_dump_json(exclude=None if include_usage else {"usage"}))

        try:
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                prompt_index, output = item
                state = states[prompt_index]
                state.cached_tokens = max(state.cached_tokens, output.num_cached_tokens)
                for completion in output.outputs:
                    choice = self._stream_choice(prompt_index, prompts[prompt_index], state, completion, body)
                    if choice is not None:
                        yield chunk([choice])
                item = await anext(outputs, None)
            if include_usage:
                generated = sum(c.num_tokens for s in states for c in s.choices.values())
                num_prompt_tokens = sum(s.num_prompt_tokens for s in states)
                usage = usage_info(num_prompt_tokens, generated, sum(s.cached_tokens for s in states))
                yield chunk([], usage)
        except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
            yield sse_error(exc)
        finally:
            await outputs.aclose()
        yield sse("[DONE]")

    def _stream_choice(self, prompt_index: int, prompt: _Prompt, state: _RequestState, completion: CompletionOutput,
                       body: CompletionRequest) -> CompletionChoice | None:
        choice = state.choices.setdefault(completion.index, _ChoiceState())
        text = completion.text
        if body.echo and not choice.echoed:
            choice.echoed = True
            text = self._prompt_text(prompt) + text
        choice.num_tokens += len(completion.token_ids)
        logprobs = None
        if body.logprobs is not None and completion.logprobs:
            start = choice.text_offset + (len(text) - len(completion.text))
            logprobs = _completion_logprobs(completion.token_ids, completion.logprobs, body.logprobs, start)
        choice.text_offset += len(text)
        if not text and completion.finish_reason is None and logprobs is None:
            return None
        return CompletionChoice(index=prompt_index * body.n + completion.index, text=text, logprobs=logprobs,
                                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)


def _check_supported(body: CompletionRequest) -> None:
    if body.suffix:
        raise OpenAIError(400, "suffix is not supported by this server", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise OpenAIError(400, "best_of different from n is not supported by this server", param="best_of")
    if body.echo and body.logprobs is not None:
        raise OpenAIError(400, "echo together with logprobs (prompt logprobs) is not supported", param="echo")


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * num_prompts
    async for index, output in outputs:
        finals[index] = output
    return finals  # type: ignore[return-value]



def _completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs], top_k: int,
                         text_offset: int) -> CompletionLogprobs:
    """The legacy completions logprobs: tokens, their logprobs, top alternatives and text offsets."""
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) or next(iter(position.values()))
        token = chosen.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(finite(chosen.logprob))
        result.text_offset.append(text_offset)
        top = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top_k),
                     key=lambda lp: lp.rank)
        result.top_logprobs.append({lp.decoded_token or "": finite(lp.logprob) for lp in top[:top_k]} or None)
        text_offset += len(token)
    return result
