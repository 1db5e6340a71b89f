"""POST /v1/completions: one or many prompts (text or token ids) completed as they are.

`echo` puts the prompt before each choice's text, and with `logprobs` the prompt tokens' logprobs before the
generated ones' (first: None): what evaluation harnesses score with, usually with `max_tokens: 0`. As vLLM does,
the engine then generates one token that the answer leaves out. `prompt_logprobs` (vLLM's) returns the prompt's
logprobs per position, in each choice.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from llmplug.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from llmplug.engine.async_llm import AsyncLLM
from llmplug.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID
from llmplug.entrypoints.openai.backpressure import EventStreamResponse
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.prompt_embeds import load_prompt_embeds
from llmplug.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    PromptLogprobs,
    SamplingRequest,
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
from llmplug.entrypoints.openai.stream_chunks import TextChunks


@dataclass(slots=True)
class _Prompt:
    """One prompt of the request: its text (None when given as token ids) and token ids."""

    text: str | None
    token_ids: list[int]  # placeholders for a prompt given as embeddings
    embeds: Any = None  # its embeddings (a checked tensor), for vLLM's prompt_embeds


@dataclass
class _ChoiceState:
    """What a streamed choice has sent so far: text length (for logprob offsets) and tokens."""

    text_offset: int = 0
    num_tokens: int = 0
    echoed: bool = False
    pending: CompletionOutput | None = None  # held until the prompt's logprobs, which its echo needs, are all in


@dataclass
class _RequestState:
    num_prompt_tokens: int = 0
    cached_tokens: int = 0
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)  # received so far


class OpenAIServingCompletion(OpenAIServing):
    """Text completions."""

    async def create(self, body: CompletionRequest, raw_request: Request) -> Response:
        """Answer one completions request (n completions of each of its prompts)."""
        model, lora = await self.resolve_model(body.model)
        self.check_caps(body)
        self.log_ignored_fields(body, "/v1/completions")
        _check_supported(body)
        check_prompt_logprobs(body, self.engine)
        if body.echo and self.renderer.tokenizer is None:
            raise OpenAIError(400, "echo needs the model's tokenizer to decode the prompt, and this server runs "
                                   "without one (skip_tokenizer_init)", param="echo")
        prompts = await self._all_prompts(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = []
        for i, prompt in enumerate(prompts):
            max_tokens = self.max_tokens(_engine_max_tokens(body), len(prompt.token_ids), "max_tokens", "prompt")
            params = self.sampling_params(body, max_tokens, body.logprobs, body.stream,
                                          prompt_logprobs=_prompt_logprobs(body))
            beam = self.beam_search_params(body, params, lora)
            streams.append(self.generate(prompt.text, prompt.token_ids, params, f"{request_id}-{i}", lora, beam,
                                         admit=False, priority=body.priority, prompt_embeds=prompt.embeds))
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
                completion = _answer(completion, body)
                num_generated += len(completion.token_ids)
                choices.append(self._choice(i * body.n + completion.index, prompt, completion, body,
                                            final.prompt_logprobs))
        usage = usage_info(sum(len(p.token_ids) for p in prompts), num_generated, cached)
        response = CompletionResponse(id=request_id, created=now(), model=model, choices=choices, usage=usage)
        return Response(response.model_dump_json(), media_type="application/json")

    async def _all_prompts(self, body: CompletionRequest) -> list[_Prompt]:
        """vLLM's `prompt_embeds` first, then `prompt`'s (beside prompt_embeds an empty prompt is none: the openai
        client must send one)."""
        if body.prompt_embeds is None:
            if body.prompt is None:
                raise OpenAIError(400, "a completion needs prompt or prompt_embeds", param="prompt")
            return await self._prompts(body.prompt)
        if body.echo:
            raise OpenAIError(400, "echo is not supported with prompt_embeds: the prompt has no text", param="echo")
        tensors = await load_prompt_embeds(self.engine, body.prompt_embeds)
        embedded = [_Prompt(None, [PLACEHOLDER_TOKEN_ID] * len(t), t) for t in tensors]
        return embedded + ([] if body.prompt in (None, "", []) else await self._prompts(body.prompt))

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

    def _choice(self, index: int, prompt: _Prompt, completion: CompletionOutput, body: CompletionRequest,
                prompt_logprobs: list[PositionLogprobs | None] | None) -> CompletionChoice:
        prefix = self._prompt_text(prompt) if body.echo else ""
        logprobs = self._logprobs(prompt, completion, body, prompt_logprobs if body.echo else None, 0)
        return CompletionChoice(index=index, text=prefix + completion.text, logprobs=logprobs,
                                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                                prompt_logprobs=format_prompt_logprobs(prompt_logprobs, len(prompt.token_ids),
                                                                       _shown_prompt_logprobs(body)))

    def _logprobs(self, prompt: _Prompt, completion: CompletionOutput, body: CompletionRequest,
                  prompt_logprobs: list[PositionLogprobs | None] | None, text_offset: int) -> CompletionLogprobs | None:
        """The choice's `logprobs` from `text_offset` on: the echoed prompt's tokens (when `echo` and not echoed
        yet: pass the prompt's logprobs), then the generated ones'."""
        if body.logprobs is None:
            return None
        logprobs = CompletionLogprobs()
        if prompt_logprobs is not None:
            positions = _prompt_positions(prompt_logprobs, len(prompt.token_ids))
            _add_logprobs(logprobs, prompt.token_ids, positions, body.logprobs, text_offset, self._decode)
            text_offset += len(self._prompt_text(prompt))
        if completion.logprobs is not None:
            _add_logprobs(logprobs, completion.token_ids, completion.logprobs, body.logprobs, text_offset,
                          self._decode)
        return logprobs

    def _decode(self, token_ids: list[int]) -> str:
        return self.renderer.need_tokenizer().decode(token_ids)

    async def _stream(self, first: tuple[int, RequestOutput], outputs: AsyncGenerator[tuple[int, RequestOutput], None],
                      request_id: str, model: str, body: CompletionRequest,
                      prompts: list[_Prompt]) -> AsyncIterator[str]:
        """One chunk per new piece of text of any choice; usage; [DONE]."""
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        created = now()
        states = [_RequestState(num_prompt_tokens=len(p.token_ids)) for p in prompts]

        def chunk_json(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            message = CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)
            return message.model_dump_json(exclude=None if include_usage else {"usage"})

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse(chunk_json(choices, usage))

        # most chunks are one choice's next text and nothing else: those are filled into a template
        plain = not (include_usage and options.continuous_usage_stats)
        text_chunks: dict[int, TextChunks] = {}

        def text_chunk(index: int, text: str) -> str:
            if index not in text_chunks:
                text_chunks[index] = TextChunks(lambda content: chunk_json([CompletionChoice(index=index,
                                                                                             text=content)]))
            return text_chunks[index](text)

        try:
            item: tuple[int, RequestOutput] | None = first
            while item is not None:
                prompt_index, output = item
                state = states[prompt_index]
                state.cached_tokens = max(state.cached_tokens, output.num_cached_tokens)
                state.prompt_logprobs += output.prompt_logprobs or []
                for completion in output.outputs:
                    choice = self._stream_choice(prompt_index, prompts[prompt_index], state, completion, body)
                    if choice is not None and plain and _text_only(choice):
                        yield text_chunk(choice.index, choice.text)
                    elif choice is not None:
                        yield chunk([choice], self._chunk_usage(body, state, completion.index))
                item = await anext(outputs, None)
            for prompt_index, state in enumerate(states):  # held back for prompt logprobs that never came
                for index, held in state.choices.items():
                    if held.pending is not None:
                        empty = CompletionOutput(index=index, text="", token_ids=[])
                        choice = self._stream_choice(prompt_index, prompts[prompt_index], state, empty, body, True)
                        yield chunk([choice], self._chunk_usage(body, state, index))
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

    def _chunk_usage(self, body: CompletionRequest, state: _RequestState, index: int) -> UsageInfo | None:
        """vLLM's `continuous_usage_stats`: every chunk's usage, of its prompt and its choice so far."""
        options = body.stream_options
        if not (options and options.include_usage and options.continuous_usage_stats):
            return None
        return usage_info(state.num_prompt_tokens, state.choices[index].num_tokens, state.cached_tokens)

    def _stream_choice(self, prompt_index: int, prompt: _Prompt, state: _RequestState, completion: CompletionOutput,
                       body: CompletionRequest, flush: bool = False) -> CompletionChoice | None:
        """The chunk of one choice's delta; the first carries the echoed prompt (and its logprobs)."""
        choice = state.choices.setdefault(completion.index, _ChoiceState())
        completion = _answer(_merge(choice.pending, completion), body)
        choice.pending = None
        echo = body.echo and not choice.echoed
        if echo and body.logprobs is not None and not flush and not _has_prompt_logprobs(state, prompt):
            choice.pending = completion  # another choice of the prompt computes its logprobs: wait for them
            return None
        text = completion.text
        if echo:
            choice.echoed = True
            text = self._prompt_text(prompt) + text
        choice.num_tokens += len(completion.token_ids)
        logprobs = None
        if completion.logprobs or echo:
            logprobs = self._logprobs(prompt, completion, body, state.prompt_logprobs if echo else None,
                                      choice.text_offset)
        choice.text_offset += len(text)
        if not text and completion.finish_reason is None and logprobs is None:
            return None
        return CompletionChoice(index=prompt_index * body.n + completion.index, text=text, logprobs=logprobs,
                                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)


def _text_only(choice: CompletionChoice) -> bool:
    """True when the choice says nothing but its text: its chunk is a TextChunks one."""
    return choice.logprobs is None and choice.finish_reason is None and choice.stop_reason is None and \
        choice.prompt_logprobs is None


def _check_supported(body: CompletionRequest) -> None:
    if body.suffix:
        raise OpenAIError(400, "suffix is not supported by this server", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise OpenAIError(400, "best_of different from n is not supported by this server", param="best_of")
    if body.max_tokens == 0 and not body.echo:
        raise OpenAIError(400, "max_tokens is 0: without echo the answer would be empty; send echo true (the "
                               "prompt alone, with its logprobs when logprobs is set) or max_tokens of 1 or more",
                          param="max_tokens")
    check_sampling_fields(body)


def check_sampling_fields(body: SamplingRequest) -> None:
    """400 for the fields of chat and completions requests whose value would be ignored in this combination."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream true", param="stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise OpenAIError(400, "prompt_logprobs is not available with stream true (as in vLLM); with echo and "
                               "logprobs a completions stream carries the prompt's logprobs", param="prompt_logprobs")
    if body.length_penalty != 1.0 and not body.use_beam_search:
        raise OpenAIError(400, "length_penalty applies to beam search only: set use_beam_search true or leave it "
                               "out", param="length_penalty")
    if body.use_beam_search and body.prompt_logprobs is not None:
        raise OpenAIError(400, "use_beam_search cannot be combined with prompt_logprobs", param="prompt_logprobs")


def check_prompt_logprobs(body: SamplingRequest, engine: AsyncLLM) -> None:
    """400 naming `prompt_logprobs` beyond the engine's limit, before anything is queued."""
    top = min(engine.config.decoding.max_logprobs, engine.vocab_size)
    if body.prompt_logprobs is not None and body.prompt_logprobs > top:
        raise OpenAIError(400, f"prompt_logprobs is {body.prompt_logprobs}, more than this server's limit of {top} "
                               f"(decoding.max_logprobs={engine.config.decoding.max_logprobs}, vocabulary of "
                               f"{engine.vocab_size})", param="prompt_logprobs")


def _has_prompt_logprobs(state: _RequestState, prompt: _Prompt) -> bool:
    """Whether every prompt position's logprobs came (a one-token prompt has none to wait for)."""
    return len(prompt.token_ids) == 1 or len(state.prompt_logprobs) >= len(prompt.token_ids)


def _engine_max_tokens(body: CompletionRequest) -> int | None:
    """max_tokens 0 (echo only) runs as 1, as vLLM does: the engine samples a token, the answer leaves it out."""
    return 1 if body.max_tokens == 0 else body.max_tokens


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """The prompt logprobs the engine computes: as asked, and as many as `logprobs` when the prompt is echoed."""
    asked = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return max(asked, default=None)


def _shown_prompt_logprobs(body: CompletionRequest) -> int | None:
    """How many alternatives a choice's `prompt_logprobs` shows: as asked, else (as vLLM) echo's `logprobs`."""
    return body.prompt_logprobs if body.prompt_logprobs is not None else _prompt_logprobs(body)


def _answer(completion: CompletionOutput, body: CompletionRequest) -> CompletionOutput:
    """The completion as the answer shows it: with max_tokens 0, none of the token the engine generated."""
    if body.max_tokens != 0:
        return completion
    return CompletionOutput(index=completion.index, text="", token_ids=[],
                            logprobs=[] if completion.logprobs is not None else None,
                            finish_reason="length" if completion.finish_reason is not None else None,
                            error=completion.error)


def _merge(first: CompletionOutput | None, then: CompletionOutput) -> CompletionOutput:
    """One delta saying what `first` (held back) and then `then` said."""
    if first is None:
        return then
    logprobs = None if first.logprobs is None else first.logprobs + (then.logprobs or [])
    return CompletionOutput(index=then.index, text=first.text + then.text, token_ids=first.token_ids + then.token_ids,
                            cumulative_logprob=then.cumulative_logprob, logprobs=logprobs,
                            finish_reason=then.finish_reason or first.finish_reason,
                            stop_reason=then.stop_reason or first.stop_reason, error=then.error or first.error)


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * num_prompts
    async for index, output in outputs:
        finals[index] = output
    return finals  # type: ignore[return-value]


def _prompt_positions(received: list[PositionLogprobs | None], num_prompt_tokens: int) -> list[PositionLogprobs | None]:
    """One entry per prompt token: what the engine sent (a one-token prompt gets none: nothing predicts it)."""
    return (received or [None])[:num_prompt_tokens]


def format_prompt_logprobs(received: list[PositionLogprobs | None] | None, num_prompt_tokens: int,
                           top_k: int | None) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs`: per prompt position, token id -> logprob, rank and text (-inf as -9999), for the
    prompt's token and the `top_k` most likely."""
    if received is None or top_k is None:
        return None
    return [None if position is None else
            {token_id: PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for i, (token_id, lp) in enumerate(position.items()) if i == 0 or (lp.rank or 0) <= top_k}
            for position in _prompt_positions(received, num_prompt_tokens)]


def _add_logprobs(result: CompletionLogprobs, token_ids: list[int], positions: list[PositionLogprobs | None],
                  top_k: int, text_offset: int, decode: Callable[[list[int]], str]) -> None:
    """Append the legacy completions logprobs of `token_ids`: tokens, their logprobs, top alternatives and text
    offsets. A position without logprobs (a prompt's first token) has None for its logprob and alternatives."""
    for token_id, position in zip(token_ids, positions):
        if position is None:
            token, logprob, top = decode([token_id]), None, None
        else:
            chosen = position.get(token_id) or next(iter(position.values()))
            token, logprob = chosen.decoded_token or "", finite(chosen.logprob)
            ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top_k),
                            key=lambda lp: lp.rank)
            top = {lp.decoded_token or "": finite(lp.logprob) for lp in ranked[:top_k]} or None
        result.tokens.append(token)
        result.token_logprobs.append(logprob)
        result.text_offset.append(text_offset)
        result.top_logprobs.append(top)
        text_offset += len(token)
