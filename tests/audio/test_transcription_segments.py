"""The segments of one window's tokens, worked out by hand: pairs, a single timestamp ending, text a window cut off,
no timestamps; and srt / vtt cues of them."""

from __future__ import annotations

import numpy as np

from llmplug.core.outputs import CompletionOutput, RequestOutput
from llmplug.engine.transcription import TranscriptionOptions, subtitles, transcript, windows
from llmplug.engine.whisper_rules import WhisperRules

EOS, BEGIN = 50, 100  # text tokens are 0..49 ("a" + id), timestamps BEGIN + k mean k * 0.02 s
RULES = WhisperRules(EOS, BEGIN - 1, BEGIN, 50, (), (), 0.02)
TIMESTAMPS = TranscriptionOptions(timestamps=True)


def _decode(ids: list[int]) -> str:
    return "".join(f" a{t}" for t in ids if t < EOS)


def _output(tokens: list[int]) -> RequestOutput:
    return RequestOutput("r", None, [], [CompletionOutput(0, "", tokens)], True)


def _segments(token_lists: list[list[int]], seconds: float,
              options: TranscriptionOptions = TIMESTAMPS) -> tuple[list[tuple[float, float, str]], str]:
    """(start, end, text) of each segment of windows whose tokens are `token_lists`, and the joined text."""
    clip = windows(np.zeros(int(seconds * 100), np.float32), 100, 30.0)
    result = transcript(options, clip, [_output(t) for t in token_lists], RULES, _decode)
    return [(s.start, s.end, s.text) for s in result.segments], result.text


def test_pairs_and_a_single_timestamp_ending() -> None:
    tokens = [BEGIN, 1, 2, BEGIN + 50, BEGIN + 50, 3, BEGIN + 100, BEGIN + 120, EOS]
    assert _segments([tokens], 10.0) == ([(0.0, 1.0, " a1 a2"), (1.0, 2.0, " a3")], "a1 a2 a3")


def test_text_cut_off_by_the_window_ends_with_it_and_windows_are_offset() -> None:
    first = [BEGIN + 10, 1, BEGIN + 20, BEGIN + 30, 2, 3]  # the second segment never closes
    second = [BEGIN, 4, BEGIN + 25, EOS]
    assert _segments([first, second], 40.0) == (
        [(0.2, 0.4, " a1"), (0.6, 30.0, " a2 a3"), (30.0, 30.5, " a4")], "a1 a2 a3 a4")


def test_without_timestamps_each_window_is_one_segment() -> None:
    assert _segments([[1, 2, EOS], [3]], 35.0, TranscriptionOptions()) == (
        [(0.0, 30.0, " a1 a2"), (30.0, 35.0, " a3")], "a1 a2 a3")


def test_srt_and_vtt_cues() -> None:
    clip = windows(np.zeros(4000, np.float32), 100, 30.0)
    result = transcript(TIMESTAMPS, clip, [_output([BEGIN + 50, 1, BEGIN + 250])], RULES, _decode)
    assert subtitles("srt", result.segments) == "1\n00:00:01,000 --> 00:00:05,000\na1\n"
    assert subtitles("vtt", result.segments) == "WEBVTT\n\n00:00:01.000 --> 00:00:05.000\na1\n"
