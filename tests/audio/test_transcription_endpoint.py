"""/v1/audio/transcriptions through the real `openai` client against `llmplug serve`, on the tiny random Whisper with
Whisper's rules and timestamp tokens: json and text equal transformers' text per window, verbose_json / srt / vtt the
segments transformers cuts from its timestamp tokens, `stream=True` deltas that join into the same text; bad input
is a 400 naming the field and the next request is served."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from llmplug import LLM, AsyncLLM
from llmplug.engine.whisper_rules import WhisperRules
from tests.audio.conftest import encode, noise, tone
from tests.audio.whisper_fixtures import RATE, reference, reference_text

CLIP = np.concatenate([tone(30.0, RATE, hz=330.0), noise(12.0, RATE, seed=1)])  # 42 s: two windows
SHORT = tone(3.0, RATE)


ENGINE = dict(dtype="float32", block_size=4, device={"num_threads": 1}, num_gpu_blocks_override=2048)


@pytest.fixture(scope="module")
def server(timed_whisper):
    from tests.entrypoints.openai.conftest import serve

    engine = AsyncLLM(str(timed_whisper.path), **ENGINE)
    try:
        with serve(engine) as running:
            yield running
    finally:
        engine.shutdown()


def _wav(samples: np.ndarray) -> tuple[bytes, np.ndarray]:
    """A 16-bit WAV file of `samples` and the samples the server decodes from it."""
    import soundfile as sf

    data = encode(samples, RATE, "WAV", "PCM_16")
    return data, sf.read(io.BytesIO(data), dtype="float32")[0]


def _create(server, data: bytes, response_format: str, **kwargs):
    return server.client().audio.transcriptions.create(model=server.model, file=("clip.wav", data, "audio/wav"),
                                                       response_format=response_format, temperature=0.0, **kwargs)


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, minutes, secs = millis // 3_600_000, millis // 60_000 % 60, millis // 1000 % 60
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis % 1000:03d}"


def test_every_response_format_equals_transformers_per_window_and_llm_transcribe(timed_whisper, server) -> None:
    data, decoded = _wav(CLIP)
    text = reference_text(timed_whisper, decoded)
    tokens, segments = reference(timed_whisper, decoded)
    assert len(segments) > 3
    assert _create(server, data, "json").text == text
    assert _create(server, data, "text").strip() == text
    verbose = _create(server, data, "verbose_json")
    assert (verbose.task, verbose.language, verbose.duration) == ("transcribe", "en", 42.0)
    assert [(s.start, s.end, s.text) for s in verbose.segments] == [
        (pytest.approx(a, abs=1e-3), pytest.approx(b, abs=1e-3), t) for a, b, t in segments]
    silence = [timed_whisper.no_speech_prob(decoded[:30 * RATE]), timed_whisper.no_speech_prob(decoded[30 * RATE:])]
    assert [s.no_speech_prob for s in verbose.segments] == [
        pytest.approx(silence[s.seek // 3000], rel=1e-4) for s in verbose.segments]
    assert [t for s in verbose.segments for t in s.tokens if t != timed_whisper.processor.tokenizer.eos_token_id] == [
        t for window in tokens for t in window if t != timed_whisper.processor.tokenizer.eos_token_id]
    srt = [f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{t.strip()}\n" for i, (a, b, t) in enumerate(segments, 1)]
    assert _create(server, data, "srt") == "\n".join(srt)
    vtt = [f"{_clock(a, '.')} --> {_clock(b, '.')}\n{t.strip()}\n" for a, b, t in segments]
    assert _create(server, data, "vtt") == "WEBVTT\n\n" + "\n".join(vtt)
    # timestamps for json when asked by granularity: the text of the segments
    timed = _create(server, data, "verbose_json", timestamp_granularities=["segment"])
    assert [s.text for s in timed.segments] == [t for _, _, t in segments]
    # offline, the same clip gives the same text and segments
    llm = LLM(str(timed_whisper.path), **ENGINE)
    assert llm.transcribe(decoded).text == text
    offline = llm.transcribe(decoded, timestamps=True)
    assert [(s.start, s.end, s.text, s.tokens, s.no_speech_prob) for s in offline.segments] == [
        (s.start, s.end, s.text, s.tokens, pytest.approx(s.no_speech_prob, rel=1e-4)) for s in verbose.segments]
    llm.shutdown()


def test_stream_deltas_join_into_the_text_of_the_whole_answer(timed_whisper, server) -> None:
    data, decoded = _wav(CLIP)
    events = list(_create(server, data, "json", stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert [e.type for e in events[-1:]] == ["transcript.text.done"] and len(deltas) >= 2  # a window at least each
    assert "".join(deltas) == events[-1].text == reference_text(timed_whisper, decoded) == _create(server, data, "json").text


class _FailingRules(WhisperRules):
    """The folder's rules, and a processor that raises at each window's third token."""

    def logits_processors(self, timestamps: bool) -> list:
        return [*WhisperRules.logits_processors(self, timestamps), _fail_at_third_token]


def _fail_at_third_token(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    if len(output_token_ids) >= 2:
        raise RuntimeError("this window fails on purpose")
    return logits


def test_a_failing_window_ends_the_stream_with_an_error_event_and_the_server_goes_on(timed_whisper, server,
                                                                                     monkeypatch) -> None:
    import dataclasses

    import openai

    processor = server.engine.llm_engine.processor.encoder_decoder_processor
    monkeypatch.setattr(processor, "rules", _FailingRules(**dataclasses.asdict(processor.rules)))
    data, decoded = _wav(CLIP)
    with pytest.raises(openai.APIError, match="fails on purpose") as failed:
        list(_create(server, data, "json", stream=True))
    assert not isinstance(failed.value, openai.APIStatusError)  # an event of the stream, not an HTTP status
    monkeypatch.undo()
    assert _create(server, data, "json").text == reference_text(timed_whisper, decoded)


@pytest.mark.parametrize("kwargs, param, named", [
    ({"response_format": "verbose_json", "timestamp_granularities": ["word"]}, "timestamp_granularities",
     "alignment heads"),
    ({"response_format": "json", "stream": True, "data": b"not audio"}, "file", "not audio"),
    ({"response_format": "srt", "stream": True}, "stream", "segments are not streamed"),
    ({"response_format": "xml"}, "response_format", "'xml' is not one of"),
], ids=["word-granularity", "stream-bad-file", "stream-srt", "unknown-format"])
def test_bad_input_is_a_400_naming_it_and_the_next_request_works(timed_whisper, server, kwargs, param, named) -> None:
    import openai

    short, decoded = _wav(SHORT)
    data = kwargs.pop("data", short)
    with pytest.raises(openai.BadRequestError) as refused:
        _create(server, data, **kwargs)
    assert refused.value.body["param"] == param and named in refused.value.body["message"]
    assert _create(server, short, "json").text == reference_text(timed_whisper, decoded)
