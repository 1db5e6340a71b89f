"""Shared audio fixtures: synthetic clips (tones, noise; speech in tests/audio/speech.py), their encoded files, and a
tiny random Whisper with the real WhisperProcessor and transformers' greedy tokens on it."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from llmplug.testing.whisper import tiny_whisper_tokenizer


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


WHISPER_RATE = 16000
WHISPER_SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>", "<|transcribe|>",
                   "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
WHISPER_PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


@pytest.fixture(scope="module")
def tiny_whisper(tmp_path_factory) -> tuple[Path, torch.nn.Module, object]:
    """(folder, transformers' WhisperForConditionalGeneration, WhisperProcessor) of a tiny random Whisper (d_model 64,
    2 encoder + 2 decoder layers, 32 decoder positions), written by transformers."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperProcessor

    path = tmp_path_factory.mktemp("tiny-whisper")
    tokenizer = tiny_whisper_tokenizer(WHISPER_SPECIAL)
    processor = WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer)
    eot, sot = tokenizer.convert_tokens_to_ids(WHISPER_SPECIAL[:2])
    config = WhisperConfig(
        vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
        max_source_positions=1500, max_target_positions=32, eos_token_id=eot, bos_token_id=eot, pad_token_id=eot,
        decoder_start_token_id=sot, suppress_tokens=None, begin_suppress_tokens=None,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights large enough that the audio moves the tokens
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path, model, processor


def whisper_reference(model, processor, clip: np.ndarray, max_new_tokens: int, text: str = WHISPER_PROMPT) -> list[int]:
    """transformers' greedy tokens (float32) for one window of 16 kHz samples after the decoder prompt `text` (the
    plain generation loop, without Whisper's logits processors)."""
    from transformers import GenerationConfig, GenerationMixin

    features = processor.feature_extractor(clip, sampling_rate=WHISPER_RATE, return_tensors="pt").input_features
    prompt = processor.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=model.config.eos_token_id,
                              pad_token_id=model.config.pad_token_id)
    with torch.no_grad():
        out = GenerationMixin.generate(model, input_features=features, decoder_input_ids=prompt,
                                       generation_config=config)
    return out[0, prompt.shape[1]:].tolist()


@pytest.fixture(scope="module")
def timed_whisper(tmp_path_factory):
    """The tiny random Whisper with timestamp tokens and a real generation_config (tests/audio/whisper_fixtures.py),
    built with one torch thread: transformers' reference runs 10x faster so on a shared 2-core machine."""
    from tests.audio.whisper_fixtures import SUPPRESSED, build_tiny_whisper

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_tiny_whisper(tmp_path_factory.mktemp("tiny-timed-whisper"), SUPPRESSED)
    torch.set_num_threads(threads)
