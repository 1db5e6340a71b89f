"""Shared audio fixtures: synthetic clips (tones, noise) and their encoded files."""

from __future__ import annotations

import io

import numpy as np
import pytest


def tone(seconds: float, rate: int, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    """A sine of `hz`, float32 mono samples at `rate`."""
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def noise(seconds: float, rate: int, seed: int = 0, amplitude: float = 0.3) -> np.ndarray:
    """Uniform white noise, float32 mono samples at `rate`."""
    rng = np.random.default_rng(seed)
    return rng.uniform(-amplitude, amplitude, int(seconds * rate)).astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """`samples` ([n] or [n, channels]) as the bytes of a `fmt` file (soundfile's format names: WAV, FLAC, OGG,
    MP3)."""
    import soundfile as sf

    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


@pytest.fixture(scope="session")
def wav_bytes():
    """The helper that encodes samples as a 16-bit WAV file."""
    return lambda samples, rate: encode(samples, rate, "WAV", "PCM_16")
