"""Encoder-decoder prompts (Whisper): the audio for the encoder, the text the decoder starts from.

vLLM's inputs are taken: an explicit prompt `{"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio":
(samples, rate)}}, "decoder_prompt": "<|startoftranscript|>..."}` (its ExplicitEncoderDecoderPrompt; the decoder
prompt text, `{"prompt": ...}` or `{"prompt_token_ids": [...]}`, or None for `<|startoftranscript|>` alone), and the
shorthand `{"prompt": "<|startoftranscript|>...", "multi_modal_data": {"audio": (samples, rate)}}`.

The model folder's processor (transformers' WhisperProcessor: its feature extractor is numpy, no torchaudio) turns
the clip, resampled to its rate, into log-mel frames padded to one window (30 s); the decoder prompt is tokenized as
written (no special tokens added). The clip becomes one `MultiModalFeature` (modality "audio", content hash of the
frames, its span the encoder's states) that the request keeps as its `encoder_feature`: the model runner computes the
cross-attention keys and values from it once per request, and the prefix cache names every decoder block with its
hash. Processing runs where the request is made (the caller's thread for `LLM`, a worker thread for `AsyncLLM`).
The folder's generation rules (`rules`: suppressed tokens, timestamps) are read here once for `LLM.transcribe` and
the /v1/audio endpoints; a plain `generate` takes its sampling params as given (vLLM's way).
"""

from __future__ import annotations

import threading
from typing import Any

from llmplug.core.errors import InvalidRequestError, ModelLoadError
from llmplug.engine.multimodal import MultiModalFeature, content_hash
from llmplug.engine.whisper_rules import WhisperRules

__all__ = ["EncoderDecoderProcessor", "is_encoder_decoder_prompt"]

START_OF_TRANSCRIPT = "<|startoftranscript|>"  # the decoder prompt when none is given (vLLM's default for Whisper)


def is_encoder_decoder_prompt(prompt: Any) -> bool:
    """True for vLLM's explicit form: a dict with "encoder_prompt" (and "decoder_prompt")."""
    return isinstance(prompt, dict) and "encoder_prompt" in prompt


class EncoderDecoderProcessor:
    """The model folder's Whisper processor, run on one prompt: (decoder text, decoder token ids, the audio feature)."""

    def __init__(self, model_path: str, trust_remote_code: bool = False) -> None:
        from transformers import AutoProcessor

        try:
            self.hf_processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, ImportError) as error:
            raise ModelLoadError(f"{model_path}: the encoder-decoder model's processor (a WhisperProcessor: "
                                 f"preprocessor_config.json and the tokenizer) cannot be loaded: {error}") from error
        extractor = self.hf_processor.feature_extractor
        self.sampling_rate = int(extractor.sampling_rate)
        self.max_seconds = float(extractor.chunk_length)  # one encoder window
        # Whisper's generation rules (suppressed tokens, timestamps): one timestamp step is one encoder position,
        # two mel frames
        self.rules = WhisperRules.from_folder(model_path, self.hf_processor.tokenizer,
                                              2 * extractor.hop_length / self.sampling_rate)
        self._lock = threading.Lock()  # a processor and its tokenizer are not documented as thread-safe

    def process(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """{"prompt": decoder text or None, "prompt_token_ids": the decoder's, "mm_features": [], "encoder_feature":
        the audio}; InvalidRequestError naming what is wrong (no audio, a bad clip, a clip longer than a window)."""
        decoder, mm_data = _split(prompt)
        samples = self._audio(mm_data)
        text, token_ids = self._decoder_prompt(decoder)
        with self._lock:
            frames = self.hf_processor.feature_extractor(samples, sampling_rate=self.sampling_rate,
                                                         return_tensors="pt")["input_features"]
        data = {"input_features": frames.contiguous()}  # [1, n_mels, window frames]
        feature = MultiModalFeature("audio", content_hash(data), data, 0, frames.shape[-1] // 2)
        return {"prompt": text, "prompt_token_ids": token_ids, "mm_features": [], "encoder_feature": feature}

    def _audio(self, mm_data: Any) -> Any:
        """The one clip of `multi_modal_data`, mono float32 at the processor's rate, at most one window long."""
        from llmplug.multimodal.audio import to_audio

        if not isinstance(mm_data, dict) or "audio" not in mm_data:
            raise InvalidRequestError("an encoder-decoder (speech) model needs audio: multi_modal_data={'audio': "
                                      "(samples, sampling_rate)} in the prompt or its encoder_prompt",
                                      param="multi_modal_data")
        unknown = sorted(set(mm_data) - {"audio"})
        if unknown:
            raise InvalidRequestError(f"multi_modal_data holds {unknown}; this model takes 'audio' only",
                                      param="multi_modal_data")
        clip = mm_data["audio"]
        if isinstance(clip, list):
            if len(clip) != 1:
                raise InvalidRequestError(f"multi_modal_data['audio'] holds {len(clip)} clips; an encoder-decoder "
                                          "prompt takes one", param="multi_modal_data")
            clip = clip[0]
        samples = to_audio(clip, self.sampling_rate, "multi_modal_data['audio']")
        seconds = len(samples) / self.sampling_rate
        if seconds > self.max_seconds:
            raise InvalidRequestError(
                f"multi_modal_data['audio'] is {seconds:.1f} s long, more than the model's window of "
                f"{self.max_seconds:g} s: split it into windows of at most {self.max_seconds:g} s (one prompt each)",
                param="multi_modal_data")
        return samples

    def _decoder_prompt(self, decoder: Any) -> tuple[str | None, Any]:
        """(text, token ids) of the decoder prompt: text is tokenized as written, no special tokens added; given ids
        are passed on as they are (the input processor checks them like any prompt's)."""
        if decoder is None:
            decoder = START_OF_TRANSCRIPT
        if isinstance(decoder, dict) and "prompt_token_ids" in decoder:
            return decoder.get("prompt"), decoder["prompt_token_ids"]
        text = decoder.get("prompt") if isinstance(decoder, dict) else decoder
        if not isinstance(text, str):
            raise InvalidRequestError("decoder_prompt must be text, {'prompt': text} or {'prompt_token_ids': ids}",
                                      param="decoder_prompt")
        with self._lock:
            return text, list(self.hf_processor.tokenizer(text, add_special_tokens=False)["input_ids"])


def _split(prompt: dict[str, Any]) -> tuple[Any, Any]:
    """(decoder prompt, multi_modal_data) of the explicit form or the shorthand."""
    if not is_encoder_decoder_prompt(prompt):
        return {k: v for k, v in prompt.items() if k != "multi_modal_data"}, prompt.get("multi_modal_data")
    encoder = prompt["encoder_prompt"]
    if not isinstance(encoder, dict):
        raise InvalidRequestError("encoder_prompt must be a dict such as {'prompt': '', 'multi_modal_data': "
                                  "{'audio': (samples, sampling_rate)}}", param="encoder_prompt")
    if encoder.get("prompt") or encoder.get("prompt_token_ids"):
        raise InvalidRequestError("a speech model's encoder_prompt takes audio only: leave its 'prompt' empty and "
                                  "put the text in decoder_prompt", param="encoder_prompt")
    return prompt.get("decoder_prompt"), encoder.get("multi_modal_data")
