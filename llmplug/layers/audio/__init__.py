"""Audio blocks: the Whisper encoder (`WhisperEncoder`, from a `WhisperEncoderConfig` that
`whisper_encoder_config` reads from a WhisperConfig or Qwen2-Audio's `audio_config`), loading transformers'
checkpoint names through its `load_weights` (`with_zero_k_bias`: Whisper's bias-free keys, for a fused q/k/v)."""

from llmplug.layers.audio.whisper_encoder import (
    WhisperEncoder,
    WhisperEncoderConfig,
    whisper_encoder_config,
    with_zero_k_bias,
)

__all__ = ["WhisperEncoder", "WhisperEncoderConfig", "whisper_encoder_config", "with_zero_k_bias"]
