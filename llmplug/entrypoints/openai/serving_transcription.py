"""/v1/audio/transcriptions and /v1/audio/translations: OpenAI's speech-to-text endpoints on a Whisper model.

The request is OpenAI's multipart form: `file` (an encoded clip: WAV, FLAC, OGG, MP3, ...), `model`, `language`
(ISO 639-1, default "en"), `prompt` (earlier text the decoder is conditioned on), `response_format` (json, text,
srt, vtt, verbose_json), `temperature`, `timestamp_granularities[]` ("segment"; "word" is refused) and `stream`.
The clip is decoded and resampled to the processor's rate off the event loop (llmplug.multimodal.audio, under the
server's byte and duration caps), cut into the model's 30 s windows, and each window is one request of the engine,
all in flight together, with the folder's generation rules as logits processors (`llmplug.engine.transcription`,
shared with `LLM.transcribe`: windows, decoder prompt, segments from the timestamp tokens, srt / vtt). srt, vtt,
verbose_json and `timestamp_granularities=["segment"]` decode with timestamps when the tokenizer has them.

`stream=true` (json or text) answers with OpenAI's server-sent events, which the `openai` client parses:
`{"type": "transcript.text.delta", "delta": ...}` as the windows' text grows, in window order, then
`{"type": "transcript.text.done", "text": ...}` and `[DONE]`; a window that fails ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from llmplug.core.errors import InvalidRequestError
from llmplug.core.outputs import RequestOutput
from llmplug.core.params import SamplingParams
from llmplug.engine.transcription import (
    Transcription,
    TranscriptionOptions,
    Window,
    decoder_prompt,
    join_texts,
    no_speech_params,
    no_speech_prompt,
    sampling_params,
    subtitles,
    transcript,
    windows,
)
from llmplug.entrypoints.openai.backpressure import EventStreamResponse
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.serving_engine import (
    SSE_HEADERS,
    OpenAIServing,
    last_output,
    merge,
    sse,
    sse_error,
    until_disconnected,
)
from llmplug.multimodal.media import MediaPolicy, decode_audio_bytes

__all__ = ["OpenAIServingTranscription"]

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
TIMESTAMP_FORMATS = ("srt", "vtt", "verbose_json")  # their segments come from the model's timestamp tokens
STREAM_FORMATS = ("json", "text")


@dataclass(frozen=True, slots=True)
class TranscriptionForm:
    """The checked fields of one request's form."""

    data: bytes
    model: str | None
    language: str
    prompt: str | None
    response_format: str
    temperature: float
    segment_timestamps: bool  # timestamp_granularities holds "segment"
    stream: bool

    def options(self, task: str, has_timestamps: bool) -> TranscriptionOptions:
        """The transcription it asks for; timestamps only where the model's tokenizer has them."""
        wants = self.response_format in TIMESTAMP_FORMATS or self.segment_timestamps
        return TranscriptionOptions(self.language, task, self.prompt, self.temperature, wants and has_timestamps)


class OpenAIServingTranscription(OpenAIServing):
    """Transcribes (or translates into English) an uploaded clip with the served encoder-decoder model."""

    def __init__(self, *args: Any, media: MediaPolicy, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.media = media

    async def create(self, raw_request: Request, task: str) -> Response:
        """Answer one multipart request; `task` is "transcribe" or "translate"."""
        processor = self.engine.llm_engine.processor.encoder_decoder_processor
        if processor is None:
            raise OpenAIError(400, f"/v1/audio/{task}s needs a speech model (Whisper); {self.engine.model_name} is "
                                   "not an encoder-decoder model", code="wrong_model_kind")
        form = await _read_form(raw_request)
        self.check_model(form.model)
        options = form.options(task, processor.rules.timestamp_begin is not None)
        tokenizer = self.engine.get_tokenizer()
        try:
            options.check(tokenizer)
        except InvalidRequestError as error:
            raise OpenAIError(400, str(error), param=error.param) from None
        rate = processor.sampling_rate
        samples = await asyncio.to_thread(decode_audio_bytes, form.data, self.media, rate, "file")
        clip = windows(samples, rate, processor.max_seconds)
        prompt_text = decoder_prompt(options)
        prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
        params = sampling_params(options, processor.rules, self.max_tokens(None, len(prompt_ids), "prompt", "prompt"),
                                 stream=form.stream)
        request_id = f"transcription-{uuid.uuid4().hex}"
        streams = self._per_window(clip, rate, prompt_text, prompt_ids, params, request_id)
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731 - drops the timestamps
        if form.stream:
            outputs = merge(streams)  # every window in flight at once
            first = await until_disconnected(raw_request, anext(outputs))
            return EventStreamResponse(_events(first, outputs, len(clip), decode), headers=SSE_HEADERS)
        probe = no_speech_prompt(options, processor.rules) if form.response_format == "verbose_json" else None
        if probe is not None:  # each window's no_speech_prob, from one more short request
            probe_ids = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
            streams += self._per_window(clip, rate, probe, probe_ids, no_speech_params(), f"{request_id}-no-speech")
        finals = await until_disconnected(raw_request, asyncio.gather(*(last_output(s) for s in streams)))
        result = transcript(options, clip, finals[: len(clip)], processor.rules, decode, finals[len(clip) :])
        return _response(form, result)

    def _per_window(self, clip: list[Window], rate: int, prompt_text: str, prompt_ids: list[int],
                    params: SamplingParams, request_id: str) -> list[AsyncGenerator[RequestOutput, None]]:
        """One engine request per window (started when first read)."""
        return [self.generate(prompt_text, prompt_ids, params, f"{request_id}-{i}",
                              mm_data={"audio": (window.samples, rate)})
                for i, window in enumerate(clip)]


async def _events(first: tuple[int, RequestOutput], outputs: AsyncGenerator[tuple[int, RequestOutput], None],
                  num_windows: int, decode: Callable[[list[int]], str]) -> AsyncIterator[str]:
    """OpenAI's transcript events: the joined text's growth, window by window in order, then the whole text. A
    window's text is decoded from its tokens, as the whole answer's is; while it runs, a trailing replacement
    character (a character whose bytes are still coming) is held back."""
    latest: dict[int, RequestOutput] = {}
    finished: list[str] = []  # the texts of the windows streamed to their end
    sent = ""
    try:
        item: tuple[int, RequestOutput] | None = first
        while item is not None:
            latest[item[0]] = item[1]
            while len(finished) < num_windows and len(finished) in latest:
                current = latest[len(finished)]
                window_text = decode(list(current.outputs[0].token_ids))
                text = join_texts([*finished, window_text if current.finished else window_text.rstrip("\ufffd")])
                if len(text) > len(sent) and text.startswith(sent):  # the text so far only grows
                    yield _event({"type": "transcript.text.delta", "delta": text[len(sent):]})
                    sent = text
                if not current.finished:
                    break
                finished.append(window_text)
            item = await anext(outputs, None)
        text = join_texts(finished)
        if len(text) > len(sent) and text.startswith(sent):
            yield _event({"type": "transcript.text.delta", "delta": text[len(sent):]})
        yield _event({"type": "transcript.text.done", "text": text})
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in the stream
        yield sse_error(exc)
    finally:
        await outputs.aclose()
    yield sse("[DONE]")


def _event(body: dict[str, Any]) -> str:
    return sse(json.dumps(body, ensure_ascii=False))


async def _read_form(raw_request: Request) -> TranscriptionForm:
    """The multipart form's fields, checked; 400 naming the field that is missing or wrong."""
    try:
        form = await raw_request.form()
    except Exception as error:  # not multipart, or malformed: the client's error
        raise OpenAIError(400, f"the request must be a multipart/form-data form with a `file` field: {error}",
                          param="file") from None
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise OpenAIError(400, "the form has no `file` field holding the audio file", param="file")
    response_format = _text(form, "response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise OpenAIError(400, f"response_format {response_format!r} is not one of {', '.join(RESPONSE_FORMATS)}",
                          param="response_format")
    try:
        temperature = float(_text(form, "temperature") or 0.0)
    except ValueError:
        raise OpenAIError(400, "temperature must be a number", param="temperature") from None
    if not 0.0 <= temperature <= 2.0:
        raise OpenAIError(400, f"temperature {temperature} is outside [0, 2]", param="temperature")
    segments = _granularities(form)
    stream = (_text(form, "stream") or "false").lower() == "true"
    if stream and (response_format not in STREAM_FORMATS or segments):
        raise OpenAIError(400, f"stream=true streams text: response_format must be json or text (not "
                               f"{response_format!r}) and timestamp_granularities empty; segments are not streamed",
                          param="stream")
    return TranscriptionForm(await upload.read(), _text(form, "model"), _text(form, "language") or "en",
                             _text(form, "prompt"), response_format, temperature, segments, stream)


def _granularities(form: Any) -> bool:
    """Whether `timestamp_granularities` (the openai client sends `timestamp_granularities[]`) asks for segments;
    400 for "word" and for anything else."""
    values = [v for name in ("timestamp_granularities[]", "timestamp_granularities") for v in form.getlist(name)]
    for value in values:
        if value == "word":
            raise OpenAIError(400, "timestamp_granularities 'word' is not supported: word timings need the model's "
                                   "alignment heads (cross-attention weights aligned by dynamic time warping), which "
                                   "this server does not compute; send 'segment'", param="timestamp_granularities")
        if value != "segment":
            raise OpenAIError(400, f"timestamp_granularities {value!r} is not one of 'segment', 'word'",
                              param="timestamp_granularities")
    return bool(values)


def _text(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(400, f"the form field `{name}` must be text, not a file", param=name)
    return value


def _response(form: TranscriptionForm, result: Transcription) -> Response:
    """The answer in the asked format."""
    usage = {"type": "duration", "seconds": math.ceil(result.duration)}
    if form.response_format == "json":
        return JSONResponse({"text": result.text, "usage": usage})
    if form.response_format == "text":
        return PlainTextResponse(result.text)
    if form.response_format in ("srt", "vtt"):
        return PlainTextResponse(subtitles(form.response_format, result.segments))
    return JSONResponse({"task": result.task, "language": result.language, "duration": result.duration,
                         "text": result.text, "segments": [dataclasses.asdict(s) for s in result.segments],
                         "usage": usage})

