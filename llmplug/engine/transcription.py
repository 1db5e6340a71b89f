"""Transcription with Whisper, shared by `LLM.transcribe` and the /v1/audio endpoints: the clip's fixed windows, each
window's decoder prompt and sampling params, its segments from the timestamp tokens, the joined text and the
subtitle formats.

A clip is cut into windows of the model's 30 s (vLLM's way: fixed, decoded in parallel, one engine request each;
transformers and OpenAI's whisper decode sequentially, seeking to the last timestamp). The decoder prompt is vLLM's:
`<|startofprev|> prompt` when a prompt is given, then `<|startoftranscript|><|lang|><|task|>`, then
`<|notimestamps|>` unless timestamps are asked for. With timestamps the window's tokens read `<|t0|> text <|t1|>
<|t1|> text <|t2|> ...`: each pair is one segment, offset by the window's start; text after the last timestamp (the
window ended before its segment closed) is a segment ending where the window ends (or where it starts, when the model
put its start past the clip's end). Without timestamps each window is one segment.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from llmplug.core.errors import InvalidRequestError
from llmplug.core.outputs import RequestOutput
from llmplug.core.params import RequestOutputKind, SamplingParams
from llmplug.engine.whisper_rules import WhisperRules

__all__ = ["Transcription", "TranscriptionOptions", "TranscriptionSegment", "Window", "decoder_prompt",
           "join_texts", "load_clip", "no_speech_params", "no_speech_prob", "no_speech_prompt", "sampling_params", "subtitles", "transcript", "windows"]

TASKS = ("transcribe", "translate")


@dataclass(frozen=True, slots=True)
class TranscriptionOptions:
    """What one transcription asks for."""

    language: str = "en"
    task: str = "transcribe"
    prompt: str | None = None
    temperature: float = 0.0
    timestamps: bool = False

    def check(self, tokenizer: Any) -> None:
        """InvalidRequestError naming the option that is wrong."""
        if self.task not in TASKS:
            raise InvalidRequestError(f"task {self.task!r} is not one of {', '.join(TASKS)}", param="task")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature {self.temperature} is outside [0, 2]", param="temperature")
        if tokenizer.convert_tokens_to_ids(f"<|{self.language}|>") in (None, tokenizer.unk_token_id):
            raise InvalidRequestError(f"language {self.language!r} is not one this model knows (its tokenizer has no "
                                      f"<|{self.language}|> token); send an ISO 639-1 code such as 'en'",
                                      param="language")


@dataclass(frozen=True, slots=True)
class Window:
    """One fixed window of the clip: its samples and where it lies, in seconds."""

    start: float
    end: float
    samples: np.ndarray


@dataclass(frozen=True, slots=True)
class TranscriptionSegment:
    """One segment of verbose_json (OpenAI's fields; `no_speech_prob` is its window's, None when not computed)."""

    id: int
    seek: int  # the window's start in mel frames (100 per second), as OpenAI's whisper reports it
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float | None
    compression_ratio: float
    no_speech_prob: float | None = None


@dataclass(slots=True)
class Transcription:
    """A whole clip's transcript: the joined text, its segments and each window's engine output."""

    text: str
    language: str
    task: str
    duration: float
    segments: list[TranscriptionSegment]
    outputs: list[RequestOutput] = field(repr=False)


def load_clip(audio: Any, rate: int) -> np.ndarray:
    """Mono float32 samples at `rate` of `audio`: the bytes of an encoded file (WAV, FLAC, OGG, MP3, ...; no length
    cap offline), vLLM's `(samples, sampling_rate)` tuple, or samples alone at `rate`."""
    from llmplug.multimodal.audio import decode_audio, to_audio

    if isinstance(audio, (bytes, bytearray)):
        return decode_audio(bytes(audio), rate, float("inf"), "audio")
    return to_audio(audio, rate, "audio")


def windows(samples: np.ndarray, rate: int, seconds: float) -> list[Window]:
    """The clip cut into windows of `seconds` (the last one shorter); one empty window for an empty clip."""
    step = int(seconds * rate)
    duration = len(samples) / rate
    return [Window(start / rate, min((start + step) / rate, duration), samples[start : start + step])
            for start in range(0, max(len(samples), 1), step)]


def decoder_prompt(options: TranscriptionOptions) -> str:
    """Whisper's decoder prompt of one window (vLLM's)."""
    stamps = "" if options.timestamps else "<|notimestamps|>"
    return f"{_previous(options)}<|startoftranscript|><|{options.language}|><|{options.task}|>{stamps}"


def no_speech_prompt(options: TranscriptionOptions, rules: WhisperRules) -> str | None:
    """The prompt whose last token's logprob is the window's no_speech_prob (OpenAI's whisper: the probability of
    <|nospeech|> right after <|startoftranscript|>, before any rule); None when the tokenizer has no such token."""
    if rules.no_speech_token is None:
        return None
    return f"{_previous(options)}<|startoftranscript|>{rules.no_speech_token}"


def no_speech_params() -> SamplingParams:
    """The params of a no-speech prompt: its prompt logprobs, one token."""
    return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)


def no_speech_prob(output: RequestOutput) -> float:
    """The probability of the no-speech prompt's last token, from its prompt logprobs."""
    last = output.prompt_logprobs[-1]
    return math.exp(last[output.prompt_token_ids[-1]].logprob)


def _previous(options: TranscriptionOptions) -> str:
    prompt = options.prompt
    return f"<|startofprev|> {prompt.strip()}" if prompt and prompt.strip() else ""


def sampling_params(options: TranscriptionOptions, rules: WhisperRules, max_tokens: int,
                    stream: bool = False) -> SamplingParams:
    """The params of every window: Whisper's rules as logits processors; each token's logprob with timestamps (for
    the segments' avg_logprob)."""
    return SamplingParams(temperature=options.temperature, max_tokens=max_tokens,
                          logprobs=0 if options.timestamps else None,
                          logits_processors=rules.logits_processors(options.timestamps),
                          output_kind=RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY)


def transcript(options: TranscriptionOptions, clip_windows: Sequence[Window], outputs: Sequence[RequestOutput],
               rules: WhisperRules, decode: Callable[[list[int]], str],
               no_speech: Sequence[RequestOutput] = ()) -> Transcription:
    """The transcript of the windows' final outputs. `decode` is the tokenizer's (special tokens skipped; Whisper's
    tokenizer leaves the timestamp tokens out of the text): every text is decoded from the tokens, not taken from the
    engine's detokenizer, which would keep the timestamps (they are not special tokens). `no_speech`: the outputs of
    each window's `no_speech_prompt`, when asked for."""
    segments: list[TranscriptionSegment] = []
    texts = []
    for i, (window, output) in enumerate(zip(clip_windows, outputs)):
        pieces = _window_segments(options, window, output, rules, decode)
        texts.append("".join(piece[2] for piece in pieces))
        silence = no_speech_prob(no_speech[i]) if no_speech else None
        for start, end, text, tokens, logprobs in pieces:
            segments.append(_segment(len(segments), window, start, end, text, tokens, logprobs, options.temperature,
                                     silence))
    duration = clip_windows[-1].end if clip_windows else 0.0
    return Transcription(join_texts(texts), options.language, options.task, duration, segments, list(outputs))


def join_texts(texts: Sequence[str]) -> str:
    """The windows' texts as one: each stripped, the non-empty ones joined by a space."""
    return " ".join(text.strip() for text in texts if text.strip())


def subtitles(kind: str, segments: Sequence[TranscriptionSegment]) -> str:
    """srt or vtt cues, one per segment."""
    separator = "," if kind == "srt" else "."
    cues = []
    for number, segment in enumerate(segments, start=1):
        span = f"{_clock(segment.start, separator)} --> {_clock(segment.end, separator)}"
        text = segment.text.strip()
        cues.append(f"{number}\n{span}\n{text}\n" if kind == "srt" else f"{span}\n{text}\n")
    return ("" if kind == "srt" else "WEBVTT\n\n") + "\n".join(cues)


# (start s, end s, text, token ids, logprob of each token or None) of one segment
_Piece = tuple[float, float, str, list[int], list[float] | None]


def _window_segments(options: TranscriptionOptions, window: Window, output: RequestOutput, rules: WhisperRules,
                     decode: Callable[[list[int]], str]) -> list[_Piece]:
    """One window's segments: cut at its timestamp tokens, or the whole window without timestamps."""
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    logprobs = _token_logprobs(tokens, completion.logprobs)
    begin = rules.timestamp_begin
    if not options.timestamps or begin is None:
        return [(window.start, window.end, decode(tokens), tokens, logprobs)]
    pieces: list[_Piece] = []
    start, opened = None, 0  # the open segment's start (seconds in the window) and its first index
    for i, token in enumerate(tokens):
        if token < begin:
            continue
        if start is not None and _has_text(tokens[opened:i], rules):  # text, then a timestamp: it closes
            pieces.append(_piece(window, tokens, logprobs, opened, i + 1, start, (token - begin) * rules.time_precision,
                                 decode))
            start = None
        elif start is None:
            start, opened = (token - begin) * rules.time_precision, i
    if start is not None and _has_text(tokens[opened:], rules):  # cut off: it ends with the window (or its start)
        last = len(tokens) - (tokens[-1] == rules.eos_token_id)
        pieces.append(_piece(window, tokens, logprobs, opened, last, start, max(start, window.end - window.start),
                             decode))
    return pieces


def _has_text(span: list[int], rules: WhisperRules) -> bool:
    """Whether `span` holds a token that is neither a timestamp nor the end of text."""
    return any(t < rules.timestamp_begin and t != rules.eos_token_id for t in span)


def _piece(window: Window, tokens: list[int], logprobs: list[float] | None, first: int, last: int, start: float,
           end: float, decode: Callable[[list[int]], str]) -> _Piece:
    """The segment of tokens[first:last] (its timestamps included), spanning start..end seconds of the window."""
    span = tokens[first:last]
    text = decode(span)
    return (window.start + start, window.start + end, text, span, None if logprobs is None else logprobs[first:last])


def _token_logprobs(tokens: list[int], positions: list[dict[int, Any]] | None) -> list[float] | None:
    """The logprob of each generated token (as the rules shaped the distribution); None when not asked for."""
    if positions is None or len(positions) < len(tokens):
        return None
    return [position[token].logprob for token, position in zip(tokens, positions)]


def _segment(index: int, window: Window, start: float, end: float, text: str, tokens: list[int],
             logprobs: list[float] | None, temperature: float, no_speech: float | None) -> TranscriptionSegment:
    encoded = text.encode()
    return TranscriptionSegment(
        id=index, seek=round(window.start * 100), start=round(start, 3), end=round(end, 3), text=text, tokens=tokens,
        temperature=temperature, avg_logprob=sum(logprobs) / len(logprobs) if logprobs else None,
        compression_ratio=len(encoded) / len(zlib.compress(encoded)) if encoded else 0.0, no_speech_prob=no_speech)


def _clock(seconds: float, separator: str) -> str:
    """hh:mm:ss,mmm (srt) or hh:mm:ss.mmm (vtt)."""
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{separator}{rest % 1000:03d}"
