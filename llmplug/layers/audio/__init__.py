"""Audio blocks: the Whisper encoder (`WhisperEncoder`, from a `WhisperEncoderConfig` that
`whisper_encoder_config` reads from a WhisperConfig or Qwen2-Audio's `audio_config`), loading transformers'
checkpoint names through its `load_weights`."""

from llmplug.layers.audio.whisper_encoder import WhisperEncoder, WhisperEncoderConfig, whisper_encoder_config

__all__ = ["WhisperEncoder", "WhisperEncoderConfig", "whisper_encoder_config"]
