"""Audio clips: encoded files (WAV, FLAC, OGG, MP3, ...) and arrays become mono float32 at a model's sampling rate.

Decoding is libsndfile's (the `soundfile` package, whose wheels carry libsndfile 1.2 with MP3 and Ogg Vorbis/Opus),
resampling soxr's high quality, as librosa does for vLLM (`librosa.load` reads with soundfile, resamples with
soxr_hq). Both come with `llmplug[audio]`. Channels are averaged to mono (librosa's `to_mono`).

Every refusal is an InvalidRequestError naming the input (`param`) and what was wrong: not audio, truncated,
longer than the duration cap. The byte cap of an encoded clip is the caller's (media.py reads URLs under it);
the duration cap is checked from the header, before the samples are decoded.
"""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np

from llmplug.core.errors import InvalidRequestError

__all__ = ["DEFAULT_MAX_AUDIO_BYTES", "DEFAULT_MAX_AUDIO_SECONDS", "decode_audio", "resample", "to_audio"]

DEFAULT_MAX_AUDIO_BYTES = 25 * 1024 * 1024  # vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25)
DEFAULT_MAX_AUDIO_SECONDS = 600.0
# libsndfile's note on a WAV whose data chunk is shorter than its header says: "data : 32000 (should be 15978)"
_SHORT_DATA = re.compile(r"^data : (\d+) \(should be (\d+)\)", re.MULTILINE)
_STREAMED_SIZES = (0, 0xFFFFFFFF)  # a WAV written to a pipe declares no length: not a truncation


def decode_audio(data: bytes, sampling_rate: int | None, max_seconds: float = DEFAULT_MAX_AUDIO_SECONDS,
                 param: str = "audio") -> np.ndarray:
    """The mono float32 samples [n] of the encoded clip `data`, resampled to `sampling_rate` (None: the file's)."""
    import soundfile as sf

    try:
        with sf.SoundFile(io.BytesIO(data)) as clip:
            seconds = clip.frames / clip.samplerate
            if seconds > max_seconds:
                raise InvalidRequestError(f"{param}: the audio is {seconds:.1f} s long, more than the limit of "
                                          f"{max_seconds:g} s (--max-audio-clip-seconds)", param=param)
            samples = clip.read(dtype="float32", always_2d=True)  # [frames, channels]
            _check_complete(clip, len(samples), param)
            rate = clip.samplerate
    except sf.LibsndfileError as error:
        raise InvalidRequestError(f"{param}: the data is not audio in a supported format (WAV, FLAC, OGG, MP3, "
                                  f"AIFF, ...), or it is corrupt: {_reason(error)}", param=param) from None
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    return resample(mono, rate, sampling_rate or rate)


def _check_complete(clip: Any, num_read: int, param: str) -> None:
    """InvalidRequestError when the file ends before the samples its header declares."""
    short = _SHORT_DATA.search(clip.extra_info)
    declared, present = (int(short[1]), int(short[2])) if short else (0, 0)
    if short and declared not in _STREAMED_SIZES and present < declared:
        raise InvalidRequestError(f"{param}: the audio is truncated ({clip.format} data of {present} bytes where its "
                                  f"header declares {declared})", param=param)
    if num_read < clip.frames:
        raise InvalidRequestError(f"{param}: the audio is truncated ({clip.format} data ends after {num_read} of "
                                  f"the {clip.frames} frames its header declares)", param=param)


def _reason(error: Exception) -> str:
    """libsndfile's message without the file object's repr ("Error opening <_io.BytesIO ...>: ")."""
    text = str(error)
    return text.split(">: ", 1)[1] if ">: " in text else text


def resample(samples: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """Mono float32 `samples` at `orig_rate` -> at `target_rate` (soxr's HQ, librosa's default): round(n * target /
    orig) samples."""
    samples = np.ascontiguousarray(samples, dtype=np.float32)
    if orig_rate == target_rate:
        return samples
    import soxr

    return soxr.resample(samples, orig_rate, target_rate, quality="HQ")


def to_audio(value: Any, sampling_rate: int, where: str) -> np.ndarray:
    """A clip of `multi_modal_data["audio"]` as mono float32 at `sampling_rate`: vLLM's `(samples, rate)` tuple, or
    samples alone (at `sampling_rate` already); samples a float numpy array or torch tensor, [n] or [channels, n]
    (as librosa gives them, in [-1, 1])."""
    rate = sampling_rate
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], (int, np.integer)) or int(value[1]) <= 0:
            raise InvalidRequestError(f"{where}: an audio tuple is (samples, sampling_rate) with a positive integer "
                                      "rate", param="multi_modal_data")
        value, rate = value[0], int(value[1])
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu()
        value = (value.float() if value.is_floating_point() else value).numpy()
    if not isinstance(value, np.ndarray):
        raise InvalidRequestError(f"{where} is a {type(value).__name__}; audio is a numpy array or torch tensor of "
                                  "samples, or a (samples, sampling_rate) tuple", param="multi_modal_data")
    return resample(_mono(value, where), rate, sampling_rate)


def _mono(samples: np.ndarray, where: str) -> np.ndarray:
    """[n] or [channels, n] finite float samples -> [n] float32 (channels averaged)."""
    if samples.ndim == 2 and samples.shape[0] <= 8:
        samples = samples.mean(axis=0)
    if samples.ndim != 1 or samples.size == 0 or samples.dtype.kind != "f":
        raise InvalidRequestError(f"{where} has shape {list(samples.shape)} and dtype {samples.dtype}; audio samples "
                                  "are a non-empty float [n] or [channels, n] array", param="multi_modal_data")
    samples = samples.astype(np.float32)
    if not np.isfinite(samples).all():
        raise InvalidRequestError(f"{where}: the audio holds NaN or infinite samples", param="multi_modal_data")
    return samples
