"""A tiny random Whisper that behaves like a real one: timestamp tokens in its tokenizer and a generation_config
with Whisper's rules (suppress_tokens, begin_suppress_tokens, no_timestamps_token_id, max_initial_timestamp_index,
the language and task ids), written by transformers with the real WhisperProcessor; and transformers' reference
(`WhisperForConditionalGeneration.generate`, which applies those rules itself)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizerFast,
)

from llmplug.testing.whisper import tiny_whisper_tokenizer

RATE = 16000
LANGUAGES = ["<|en|>", "<|de|>"]
SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", *LANGUAGES, "<|translate|>", "<|transcribe|>", "<|startoflm|>",
           "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]  # <|0.00|> ... <|30.00|>, right after <|notimestamps|>
MAX_TARGET_POSITIONS = 64
SUPPRESSED = ["ð", "ĵ", "ä", "Ĕ"]  # BPE tokens the random model likes: its generation_config suppresses them


@dataclass(frozen=True)
class Segment:
    """One segment transformers cut from a window's timestamp tokens."""

    start: float
    end: float
    tokens: list[int]


@dataclass(frozen=True)
class TinyWhisper:
    """The folder and transformers' model and processor of one tiny random Whisper."""

    path: Path
    model: WhisperForConditionalGeneration
    processor: WhisperProcessor

    def features(self, clip: np.ndarray) -> torch.Tensor:
        """The processor's log-mel frames of one window."""
        return self.processor.feature_extractor(clip, sampling_rate=RATE, return_tensors="pt").input_features

    def generate(self, clip: np.ndarray, *, timestamps: bool, task: str = "transcribe",
                 prompt: str | None = None) -> list[int]:
        """transformers' Whisper generation of one window (float32, greedy) under the folder's generation_config, as
        far as the decoder's context allows, in one pass (`force_unique_generate_call`: no seeking back to the last
        timestamp, as fixed windows do): the generated ids, without the decoder prompt."""
        prompt_ids = None if prompt is None else self.processor.get_prompt_ids(prompt, return_tensors="pt")
        prompt_len = (0 if prompt_ids is None else len(prompt_ids)) + 3 + (0 if timestamps else 1)
        with torch.no_grad():
            out = self.model.generate(self.features(clip), language="en", task=task, return_timestamps=timestamps,
                                      prompt_ids=prompt_ids, max_new_tokens=MAX_TARGET_POSITIONS - prompt_len,
                                      force_unique_generate_call=True, return_dict_in_generate=True)
        return out.sequences[0, prompt_len:].tolist()

    def no_speech_prob(self, clip: np.ndarray) -> float:
        """transformers' probability of the no-speech token (`no_timestamps_token_id - 1`, as its
        WhisperNoSpeechDetection reads it) right after <|startoftranscript|>: OpenAI's no_speech_prob."""
        start = torch.tensor([[self.model.generation_config.decoder_start_token_id]])
        with torch.no_grad():
            logits = self.model(input_features=self.features(clip), decoder_input_ids=start).logits  # [1, 1, vocab]
        return torch.softmax(logits[0, -1], dim=-1)[self.model.generation_config.no_timestamps_token_id - 1].item()

    def segments(self, clip: np.ndarray) -> tuple[list[int], list[Segment]]:
        """transformers' timestamp generation of one window in one pass: (the generated ids, the segments its
        `return_segments` cuts from them: start and end seconds and their tokens, timestamps included)."""
        with torch.no_grad():
            out = self.model.generate(self.features(clip), language="en", task="transcribe", return_timestamps=True,
                                      max_new_tokens=MAX_TARGET_POSITIONS - 3, force_unique_generate_call=True,
                                      return_segments=True)
        found = out["segments"][0]
        assert found, "transformers found no segment: choose another clip"
        tokens = found[0]["result"][3:].tolist()
        return tokens, [Segment(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in found]


def _generation_config(tokenizer: WhisperTokenizerFast, suppress: list[int]) -> GenerationConfig:
    """Whisper's generation fields, as the real checkpoints' generation_config.json holds them."""
    ids = tokenizer.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    return GenerationConfig(
        decoder_start_token_id=ids("<|startoftranscript|>"), eos_token_id=eot, bos_token_id=eot, pad_token_id=eot,
        no_timestamps_token_id=ids("<|notimestamps|>"), prev_sot_token_id=ids("<|startofprev|>"),
        max_initial_timestamp_index=50, is_multilingual=True, max_length=MAX_TARGET_POSITIONS,
        lang_to_id={lang: ids(lang) for lang in LANGUAGES},
        task_to_id={"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")},
        suppress_tokens=suppress, begin_suppress_tokens=[ids("Ġ"), eot],
    )


def build_tiny_whisper(path: Path, suppress: list[str]) -> TinyWhisper:
    """Write a tiny random Whisper (d_model 64, 2 + 2 layers) whose generation_config suppresses `suppress` (tokens
    of its BPE) into `path`."""
    tokenizer = tiny_whisper_tokenizer(SPECIAL, TIMESTAMPS)  # timestamps plain, as in Whisper's
    processor = WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer)
    eot, sot = tokenizer.convert_tokens_to_ids(SPECIAL[:2])
    config = WhisperConfig(
        vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
        max_source_positions=1500, max_target_positions=MAX_TARGET_POSITIONS, eos_token_id=eot, bos_token_id=eot,
        pad_token_id=eot, decoder_start_token_id=sot,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # weights large enough that the audio moves the tokens
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    model.generation_config = _generation_config(tokenizer, tokenizer.convert_tokens_to_ids(suppress))
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return TinyWhisper(path, model, processor)


def _windows(clip: np.ndarray) -> list[tuple[float, np.ndarray]]:
    return [(i / RATE, clip[i : i + 30 * RATE]) for i in range(0, len(clip), 30 * RATE)]


def reference(tiny: TinyWhisper, clip: np.ndarray) -> tuple[list[list[int]], list[tuple[float, float, str]]]:
    """transformers' tokens of each window with timestamps, and (start, end, text) of each segment transformers cuts
    from them, offset by the window's start (its text: the segment's tokens, decoded by the tokenizer); text
    left after the last pair, which transformers drops (it would decode again from there), ends with the window."""
    tokenizer = tiny.processor.tokenizer
    begin, eos = tokenizer.convert_tokens_to_ids(["<|0.00|>", "<|endoftext|>"])
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731 - it drops the timestamps
    all_tokens, segments = [], []
    for offset, window in _windows(clip):
        tokens, found = tiny.segments(window)
        all_tokens.append(tokens)
        segments += [(offset + s.start, offset + s.end, decode(s.tokens)) for s in found]
        single_ending = tokens[-2] < begin <= tokens[-1] or tokens[-3] < begin <= tokens[-2] and tokens[-1] == eos
        consumed = sum(len(s.tokens) for s in found) - (0 if single_ending else 1)  # the last pair's second stamp
        tail = [t for t in tokens[consumed:] if t != eos]
        if any(t < begin for t in tail):
            opened = (tail[0] - begin) * 0.02
            segments.append((offset + opened, offset + max(opened, len(window) / RATE), decode(tail)))
    return all_tokens, segments


def reference_text(tiny: TinyWhisper, clip: np.ndarray) -> str:
    """transformers' text of each window without timestamps, joined as OpenAI's endpoint joins windows."""
    texts = [tiny.processor.tokenizer.decode(tiny.generate(w, timestamps=False), skip_special_tokens=True)
             for _, w in _windows(clip)]
    return " ".join(t.strip() for t in texts if t.strip())
