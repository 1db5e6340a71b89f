"""/v1/audio/transcriptions and /v1/audio/translations: OpenAI's speech-to-text endpoints on a Whisper model.

The request is OpenAI's multipart form: `file` (an encoded clip: WAV, FLAC, OGG, MP3, ...), `model`, `language`
(ISO 639-1, default "en"), `prompt` (earlier text the decoder is conditioned on), `response_format` (json, text,
srt, vtt, verbose_json) and `temperature`. The clip is decoded and resampled to the processor's rate off the event
loop (llmplug.multimodal.audio, under the server's byte and duration caps), cut into windows of the model's 30 s,
and each window is one request of the engine, all in flight together; their texts are joined in order. Each window
is one segment of srt, vtt and verbose_json (the model's timestamp tokens, which would cut finer segments, are not
used yet). Whisper's decoder prompt is vLLM's: `<|startofprev|>` and the prompt when given, then
`<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>`.
"""

from __future__ import annotations

import asyncio
import math
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from llmplug.core.outputs import RequestOutput
from llmplug.core.params import SamplingParams
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.serving_engine import OpenAIServing, last_output
from llmplug.multimodal.media import MediaPolicy, decode_audio_bytes

__all__ = ["OpenAIServingTranscription"]

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


@dataclass(frozen=True, slots=True)
class TranscriptionForm:
    """The checked fields of one request's form."""

    data: bytes
    model: str | None
    language: str
    prompt: str | None
    response_format: str
    temperature: float


@dataclass(frozen=True, slots=True)
class Segment:
    """One window's transcript and where the window lies in the clip."""

    start: float
    end: float
    output: RequestOutput


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
        model = self.check_model(form.model)
        rate, window = processor.sampling_rate, processor.max_seconds
        samples = await asyncio.to_thread(decode_audio_bytes, form.data, self.media, rate, "file")
        prompt_text = _decoder_prompt(form.prompt, form.language, task)
        prompt_ids = self._token_ids(prompt_text, form.language)
        segments = await self._transcribe(samples, rate, window, prompt_text, prompt_ids, form)
        return _response(form, task, len(samples) / rate, segments, model)

    def _token_ids(self, text: str, language: str) -> list[int]:
        """The decoder prompt's ids; 400 when the tokenizer has no token for the language."""
        tokenizer = self.engine.get_tokenizer()
        if tokenizer.convert_tokens_to_ids(f"<|{language}|>") in (None, tokenizer.unk_token_id):
            raise OpenAIError(400, f"language {language!r} is not one this model knows (its tokenizer has no "
                                   f"<|{language}|> token); send an ISO 639-1 code such as 'en'", param="language")
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def _transcribe(self, samples: np.ndarray, rate: int, window: float, prompt_text: str,
                          prompt_ids: list[int], form: TranscriptionForm) -> list[Segment]:
        """One engine request per window, all in flight together; their final outputs in order."""
        params = SamplingParams(temperature=form.temperature,
                                max_tokens=self.max_tokens(None, len(prompt_ids), "prompt", "prompt"),
                                logprobs=0 if form.response_format == "verbose_json" else None)
        step = int(window * rate)
        starts = range(0, max(len(samples), 1), step)
        request_id = f"transcription-{uuid.uuid4().hex}"
        outputs = [last_output(self.generate(prompt_text, prompt_ids, params, f"{request_id}-{i}",
                                             mm_data={"audio": (samples[start : start + step], rate)}))
                   for i, start in enumerate(starts)]
        results = await asyncio.gather(*outputs)
        duration = len(samples) / rate
        return [Segment(start / rate, min((start + step) / rate, duration), output)
                for start, output in zip(starts, results)]


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
    if (_text(form, "stream") or "false").lower() == "true":
        raise OpenAIError(400, "stream is not supported by this server's transcriptions yet: send stream=false",
                          param="stream")
    return TranscriptionForm(await upload.read(), _text(form, "model"), _text(form, "language") or "en",
                             _text(form, "prompt"), response_format, temperature)


def _text(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(400, f"the form field `{name}` must be text, not a file", param=name)
    return value


def _decoder_prompt(prompt: str | None, language: str, task: str) -> str:
    """Whisper's decoder prompt (vLLM's): the earlier text after <|startofprev|>, then the task's tokens."""
    previous = f"<|startofprev|> {prompt.strip()}" if prompt and prompt.strip() else ""
    return f"{previous}<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>"


def _response(form: TranscriptionForm, task: str, duration: float, segments: list[Segment], model: str) -> Response:
    """The answer in the asked format."""
    texts = [s.output.outputs[0].text.strip() for s in segments]
    text = " ".join(t for t in texts if t)
    usage = {"type": "duration", "seconds": math.ceil(duration)}
    if form.response_format == "json":
        return JSONResponse({"text": text, "usage": usage})
    if form.response_format == "text":
        return PlainTextResponse(text)
    if form.response_format in ("srt", "vtt"):
        return PlainTextResponse(_subtitles(form.response_format, segments, texts))
    body = {"task": "translate" if task == "translate" else "transcribe", "language": form.language,
            "duration": duration, "text": text, "segments": [_segment(i, s, t, form.temperature)
                                                             for i, (s, t) in enumerate(zip(segments, texts))],
            "usage": usage}
    return JSONResponse(body)


def _segment(index: int, segment: Segment, text: str, temperature: float) -> dict[str, Any]:
    """verbose_json's segment of one window: its span, text, tokens, mean token log-probability and the text's
    compression ratio (Whisper's repetition signal)."""
    completion = segment.output.outputs[0]
    tokens = list(completion.token_ids)
    cumulative = completion.cumulative_logprob
    encoded = text.encode()
    return {
        "id": index, "seek": round(segment.start * 100), "start": segment.start, "end": segment.end, "text": text,
        "tokens": tokens, "temperature": temperature,
        "avg_logprob": cumulative / len(tokens) if tokens and cumulative is not None else None,
        "compression_ratio": len(encoded) / len(zlib.compress(encoded)) if encoded else 0.0,
    }


def _subtitles(kind: str, segments: list[Segment], texts: list[str]) -> str:
    """srt or vtt cues, one per window."""
    separator = "," if kind == "srt" else "."
    cues = []
    for i, (segment, text) in enumerate(zip(segments, texts), start=1):
        span = f"{_clock(segment.start, separator)} --> {_clock(segment.end, separator)}"
        cues.append(f"{i}\n{span}\n{text}\n" if kind == "srt" else f"{span}\n{text}\n")
    return ("" if kind == "srt" else "WEBVTT\n\n") + "\n".join(cues)


def _clock(seconds: float, separator: str) -> str:
    """hh:mm:ss,mmm (srt) or hh:mm:ss.mmm (vtt)."""
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{separator}{rest % 1000:03d}"
