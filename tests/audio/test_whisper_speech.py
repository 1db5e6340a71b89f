"""Whisper on speech: sentences spoken by espeak-ng (tests/audio/speech.py) through the whole engine against
transformers, on the tiny random checkpoint and the real WhisperProcessor of tests/audio/conftest.py.

Greedy tokens must equal transformers' `generate` (float32) on the same processor output: for a spoken sentence, for
a batch of 16 clips of 0.5 to 28 s mixing speech, tones and noise, and for each 30 s window of a 75 s spoken passage
(the windows the transcription endpoint cuts, `samples[i : i + 30 s]`).
"""

from __future__ import annotations

import numpy as np
import pytest

from llmplug import LLM, SamplingParams
from tests.audio.conftest import WHISPER_PROMPT, WHISPER_RATE as RATE, noise, tone, whisper_reference
from tests.audio.speech import speak

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A tiny model listens to the sound of a voice and writes down what it hears.",
    "Rain fell on the old stone bridge while the river carried leaves toward the sea.",
    "Seven engineers tested the new engine through the night and wrote every number down.",
    "She asked for three cups of coffee, a glass of water and the morning paper.",
    "The train to the northern coast leaves at half past nine from platform four.",
    "Numbers like forty two and one thousand and six are spoken as words.",
    "When the music stopped, everyone in the hall turned to look at the door.",
    "Please speak slowly and clearly so that the machine can follow every word.",
    "Autumn light came through the window and fell across the wooden table.",
    "He packed a map, a torch and a warm coat before climbing the hill.",
    "The library closes early on Sundays, so come back tomorrow morning.",
]
MAX_TOKENS = 12
WINDOW = 30 * RATE
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def passage() -> np.ndarray:
    """The sentences spoken one after another (about 48 s at espeak-ng's 175 words a minute)."""
    return speak(" ".join(SENTENCES), RATE)


@pytest.fixture(scope="module")
def llm(tiny_whisper) -> LLM:
    # 16 requests of 30 s windows: room for each one's cross-attention keys and values as well as its tokens
    engine = LLM(str(tiny_whisper[0]), dtype="float32", block_size=4, num_gpu_blocks_override=8192,
                 device={"num_threads": 1})
    yield engine
    engine.shutdown()


def _prompt(clip: np.ndarray) -> dict:
    return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (clip, RATE)}},
            "decoder_prompt": WHISPER_PROMPT}


def _tokens(llm: LLM, clips: list[np.ndarray]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([_prompt(c) for c in clips], GREEDY, use_tqdm=False)]


def _references(tiny_whisper, clips: list[np.ndarray]) -> list[list[int]]:
    _, model, processor = tiny_whisper
    return [whisper_reference(model, processor, clip, MAX_TOKENS) for clip in clips]


def test_a_spoken_sentence_gives_transformers_tokens(tiny_whisper, llm) -> None:
    clips = [speak(SENTENCES[0], RATE), speak(SENTENCES[1], RATE)]
    for clip in clips:  # espeak-ng spoke: loud syllables and quiet gaps (a tone or noise keeps one level)
        rms = np.sqrt(np.mean(clip[: len(clip) // 800 * 800].reshape(-1, 800) ** 2, axis=1))  # per 50 ms
        assert rms.max() > 0.1 and rms.max() > 10 * rms.min()
    expected = _references(tiny_whisper, clips)
    assert _tokens(llm, clips) == expected
    assert expected[0] != expected[1]  # what is said decides the tokens


def test_batch_of_16_speech_tone_and_noise_clips_equals_transformers_one_by_one(tiny_whisper, llm, passage) -> None:
    lengths = np.linspace(0.5, 28.0, 16)
    clips = []
    for i, seconds in enumerate(lengths):
        n = int(seconds * RATE)
        if i % 3 == 0:  # speech: a stretch of the passage, starting at another sentence each time
            start = int(1.7 * i * RATE) % (len(passage) - n)
            clips.append(passage[start : start + n])
        else:
            clips.append(tone(seconds, RATE, hz=220.0 * (1 + i % 5)) if i % 3 == 1 else noise(seconds, RATE, seed=i))
    assert sorted(len(c) for c in clips) == [len(c) for c in clips] and len({len(c) for c in clips}) == 16
    expected = _references(tiny_whisper, clips)
    assert _tokens(llm, clips) == expected
    assert len({tuple(r) for r in expected[::3]}) > 3  # the speech clips answer differently


def test_each_30s_window_of_a_75s_spoken_passage_equals_transformers(tiny_whisper, llm) -> None:
    clip = speak(" ".join(SENTENCES), RATE, words_per_minute=110)[: 75 * RATE]  # slower: 75 s of speech
    assert len(clip) == 75 * RATE
    windows = [clip[i : i + WINDOW] for i in range(0, len(clip), WINDOW)]
    assert [len(w) / RATE for w in windows] == [30.0, 30.0, 15.0]
    assert min(np.abs(w).max() for w in windows) > 0.1  # every window holds speech
    expected = _references(tiny_whisper, windows)
    assert _tokens(llm, windows) == expected
    assert len({tuple(r) for r in expected}) == 3
