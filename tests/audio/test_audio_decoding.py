"""Audio decoding (llmplug.multimodal.audio, media.py's audio URLs): files become mono float32 at the model's rate;
broken, foreign and oversized inputs are refused by name."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from scipy.signal import resample_poly

from llmplug.core.errors import InvalidRequestError
from llmplug.multimodal.audio import decode_audio, to_audio
from llmplug.multimodal.media import MediaPolicy, load_audio_url, load_input_audio
from tests.audio.conftest import encode, noise, tone


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[spectrum.argmax()])


@pytest.mark.parametrize("fmt,subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("WAV", "FLOAT")])
def test_lossless_files_decode_to_their_samples(fmt, subtype):
    clip = noise(0.5, 16000)
    decoded = decode_audio(encode(clip, 16000, fmt, subtype), 16000)
    assert decoded.dtype == np.float32 and decoded.shape == clip.shape
    np.testing.assert_allclose(decoded, clip, atol=1 / 32768 if subtype == "PCM_16" else 0)


@pytest.mark.parametrize("fmt", ["OGG", "MP3"])
def test_lossy_files_decode_to_the_same_tone(fmt):
    decoded = decode_audio(encode(tone(1.0, 16000, hz=500), 16000, fmt), 16000)
    assert abs(len(decoded) - 16000) < 1200  # an encoder's priming and padding frames
    assert dominant_hz(decoded, 16000) == pytest.approx(500, abs=2)


def test_resampled_to_the_target_rate_as_an_independent_resampler_does():
    clip = tone(1.0, 44100, hz=300) + noise(1.0, 44100, amplitude=0.05)
    decoded = decode_audio(encode(clip, 44100, "WAV", "FLOAT"), 16000)
    assert len(decoded) == 16000  # round(44100 * 16000 / 44100)
    reference = resample_poly(clip, 160, 441).astype(np.float32)  # scipy's polyphase filter, not soxr
    # the two filters differ near the band edge and at the ends; the signal is the same
    inner = slice(200, -200)
    assert np.corrcoef(decoded[inner], reference[inner])[0, 1] > 0.999
    assert dominant_hz(decoded, 16000) == pytest.approx(300, abs=2)


def test_stereo_is_averaged_to_mono():
    left, right = tone(0.25, 8000, hz=200), tone(0.25, 8000, hz=1000)
    decoded = decode_audio(encode(np.stack([left, right], 1), 8000, "WAV", "FLOAT"), None)
    np.testing.assert_allclose(decoded, (left + right) / 2, atol=1e-7)


def test_arrays_and_rate_tuples_are_resampled():
    clip = tone(0.5, 8000)
    assert to_audio(clip, 8000, "a").shape == (4000,)
    assert to_audio((clip, 8000), 16000, "a").shape == (8000,)
    import torch

    np.testing.assert_allclose(to_audio(torch.from_numpy(np.stack([clip, clip])), 8000, "a"), clip)


@pytest.mark.parametrize("value,message", [
    ("a string", "is a str"),
    (np.zeros(0, np.float32), "non-empty float"),
    (np.zeros(10, np.int16), "non-empty float"),
    (np.array([0.0, np.nan], np.float32), "NaN or infinite"),
    ((np.zeros(8, np.float32), 0), "positive integer rate"),
])
def test_unusable_arrays_are_refused_by_name(value, message):
    with pytest.raises(InvalidRequestError, match=f"multi_modal_data\\['audio'\\]\\[0\\].*{message}"):
        to_audio(value, 16000, "multi_modal_data['audio'][0]")


@pytest.mark.parametrize("fmt", ["WAV", "MP3"])
def test_a_truncated_file_is_refused(fmt):
    data = encode(tone(1.0, 16000), 16000, fmt)
    with pytest.raises(InvalidRequestError, match=r"input_audio: the audio is truncated"):
        decode_audio(data[: len(data) // 2], 16000, param="input_audio")


def test_text_and_garbage_are_refused_as_not_audio():
    for data in (b"this is a text file, not a sound\n" * 20, bytes(range(256)) * 8):
        with pytest.raises(InvalidRequestError, match="input_audio: the data is not audio in a supported format"):
            decode_audio(data, 16000, param="input_audio")


def test_policy_caps_bytes_and_seconds_before_decoding():
    data = base64.b64encode(encode(tone(2.0, 16000), 16000, "WAV", "PCM_16")).decode()
    with pytest.raises(InvalidRequestError, match="larger than the limit of 1000 bytes"):
        load_input_audio(data, MediaPolicy(max_audio_bytes=1000), 16000)
    with pytest.raises(InvalidRequestError, match=r"2\.0 s long, more than the limit of 1 s"):
        load_input_audio(data, MediaPolicy(max_audio_seconds=1.0), 16000)
    assert load_input_audio(data, MediaPolicy(), 8000).shape == (16000,)


def test_audio_urls_follow_the_media_policy(tmp_path):
    wav = encode(tone(0.5, 16000), 16000, "WAV", "PCM_16")
    url = "data:audio/wav;base64," + base64.b64encode(wav).decode()
    assert load_audio_url(url, MediaPolicy(), 16000).shape == (8000,)
    with pytest.raises(InvalidRequestError, match="a data URL must be data:audio/"):
        load_audio_url(url.replace("audio/wav", "image/png"), MediaPolicy(), 16000)
    (tmp_path / "clip.wav").write_bytes(wav)
    with pytest.raises(InvalidRequestError, match="file:// URLs are off"):
        load_audio_url(f"file://{tmp_path}/clip.wav", MediaPolicy(), 16000)
    policy = MediaPolicy.of(str(tmp_path))
    assert load_audio_url(f"file://{tmp_path}/clip.wav", policy, 16000).shape == (8000,)


def test_audio_flags_become_the_policy():
    from llmplug.entrypoints.cli import build_parser
    from llmplug.entrypoints.openai.api_server import ServerSettings

    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--max-audio-clip-filesize-mb", "0.5", "--max-audio-clip-seconds", "30"])
    policy = ServerSettings.from_args(args).media
    assert (policy.max_audio_bytes, policy.max_audio_seconds) == (512 * 1024, 30.0)
    assert ServerSettings.from_args(parser.parse_args(["serve"])).media.max_audio_bytes == 25 * 1024 * 1024
