"""Synthetic speech for the audio tests: espeak-ng (the `espeakng-loader` wheel's libespeak-ng and voice data) called
through its C API, resampled to the rate a test asks for with soxr's HQ, as llmplug resamples audio.

libespeak-ng keeps state from one utterance to the next (the same text twice in a process may differ by a few
samples; a fresh process repeats the same sequence), so a test makes each clip once and gives the same samples to
both implementations it compares.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import soxr

# espeak-ng's speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2  # espeak_Synth returns once every sample went through the callback
_INITIALIZE_DONT_EXIT = 0x8000  # an error is a return code, not exit()
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_RATE = 1  # espeakRATE: words per minute
# int callback(short *wav, int numsamples, espeak_EVENT *events); 0 goes on
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)

_lock = threading.Lock()  # libespeak-ng keeps one global synthesizer
_engine: tuple[ctypes.CDLL, int] | None = None
_chunks: list[np.ndarray] = []


@_CALLBACK
def _collect(wav, num_samples: int, _events) -> int:
    if num_samples > 0:
        _chunks.append(np.ctypeslib.as_array(wav, shape=(num_samples,)).copy())
    return 0


def _library() -> tuple[ctypes.CDLL, int]:
    """libespeak-ng initialized once (synchronous output into `_collect`, voice `en`), and its sample rate."""
    global _engine
    if _engine is None:
        import espeakng_loader

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        # espeak_Synth(text, size, position, position_type, end_position, flags, unique_identifier, user_data)
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                     ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(),
                                     _INITIALIZE_DONT_EXIT)
        if rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({rate}) with the data at {espeakng_loader.get_data_path()}")
        lib.espeak_SetSynthCallback(_collect)
        if lib.espeak_SetVoiceByName(b"en") != 0:
            raise RuntimeError("espeak-ng has no voice 'en'")
        _engine = lib, rate
    return _engine


def speak(text: str, rate: int = 16000, words_per_minute: int = 175) -> np.ndarray:
    """`text` spoken by espeak-ng's English voice: float32 mono samples in [-1, 1] at `rate`."""
    data = text.encode() + b"\0"
    with _lock:
        lib, native_rate = _library()
        lib.espeak_SetParameter(_RATE, words_per_minute, 0)
        _chunks.clear()
        error = lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if error != 0:
            raise RuntimeError(f"espeak_Synth failed ({error}) on {text!r}")
        samples = np.concatenate(_chunks) if _chunks else np.zeros(0, np.int16)
        _chunks.clear()
    samples = samples.astype(np.float32) / 32768.0  # espeak-ng's 16-bit samples
    return samples if rate == native_rate else soxr.resample(samples, native_rate, rate, quality="HQ")
