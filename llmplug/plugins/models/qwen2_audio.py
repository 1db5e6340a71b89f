"""Audio-language families: a language family that exists plus the Whisper encoder block (layers/audio), whose
states are average-pooled by 2 before its final norm, and a projector. Each clip is one run of placeholder tokens,
one per pooled state: 25 a second (a 30 s window: 750).

- Qwen2-Audio (`Qwen2AudioForConditionalGeneration`): a Qwen2 decoder; the projector is one linear layer; the
  processor's tensors are `input_features` [1, n_mels, frames] (one 30 s window, the clip padded) and
  `feature_attention_mask` [1, frames].
- AudioFlamingo3 (`AudioFlamingo3ForConditionalGeneration`): the same encoder and decoder; the projector is
  LLaVA's two-layer MLP; the processor cuts a long clip into several windows (`input_features` [windows, n_mels,
  frames], `input_features_mask`), whose valid states follow one another in the clip's run.

transformers runs the encoder over the whole padded window with the padding masked out of attention; the encoder
here stops at each window's valid states after the convolutions (which read the padding's frames, as transformers'
do), the same rows without the padding's work. Checkpoints come in transformers 5's layout (`model.audio_tower.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`) and the original one (`audio_tower.*`,
`multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`).
"""

from __future__ import annotations

import dataclasses
import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.audio import WhisperEncoder, whisper_encoder_config
from llmplug.layers.decoder import DecoderForCausalLM
from llmplug.layers.vision import LinearProjector, MLPProjector
from llmplug.plugins.models.llama import Qwen2ForCausalLM
from llmplug.plugins.models.llava import LlavaForConditionalGeneration, maybe_prefix

__all__ = ["AudioFlamingo3ForConditionalGeneration", "Qwen2AudioForConditionalGeneration"]

POOL_STRIDE = 2  # Qwen2-Audio's avg_pooler: two encoder states per token

# checkpoint prefix -> (our submodule, the prefix its own load_weights expects); the longest match wins
CHECKPOINT_PREFIXES: dict[str, tuple[str, str]] = {
    "model.language_model.": ("language_model", "model."),
    "language_model.model.": ("language_model", "model."),
    "language_model.lm_head.": ("language_model", "lm_head."),
    "lm_head.": ("language_model", "lm_head."),
    "model.audio_tower.": ("audio_tower", ""),
    "audio_tower.": ("audio_tower", ""),
    "model.multi_modal_projector.": ("multi_modal_projector", ""),
    "multi_modal_projector.": ("multi_modal_projector", ""),
}


class Qwen2AudioForConditionalGeneration(LlavaForConditionalGeneration):
    """Qwen2-Audio: Whisper encoder (pooled by 2) -> linear projector -> clip rows in the Qwen2 decoder's input
    embeddings (LLaVA's weight routing, embedding, forward and logits, inherited)."""

    # the encoder's layers shard as the ViT's (heads and MLP), its convolutions and positions are replicated; the
    # projector shards as LLaVA's (AudioFlamingo3) or is replicated (Qwen2-Audio); each rank encodes whole clips
    supports_tensor_parallel = True
    language_models: dict[str, type[DecoderForCausalLM]] = {"qwen2": Qwen2ForCausalLM}
    checkpoint_prefixes = CHECKPOINT_PREFIXES
    mask_name = "feature_attention_mask"  # the processor's name of each window's valid frames

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        # LLaVA's __init__ builds a vision tower and reads image_token_id: an audio model has neither
        nn.Module.__init__(self)
        self.config = config
        self.audio_token_id = int(config.audio_token_id)
        encoder = dataclasses.replace(whisper_encoder_config(config.audio_config), pool_stride=POOL_STRIDE)
        self.audio_tower = WhisperEncoder(encoder, prefix=maybe_prefix(prefix, "audio_tower"))
        self.multi_modal_projector = self.build_projector(config, maybe_prefix(prefix, "multi_modal_projector"))
        text_config = config.text_config
        self.language_model = self.language_model_class(text_config)(config=text_config,
                                                                      prefix=maybe_prefix(prefix, "language_model"))

    def build_projector(self, config: PretrainedConfig, prefix: str) -> nn.Module:
        """One linear layer, encoder width -> decoder width (`multi_modal_projector.linear`)."""
        return LinearProjector(config.audio_config.d_model, config.text_config.hidden_size, prefix=prefix)

    def embed_multimodal(self, input_features: torch.Tensor, **tensors: torch.Tensor) -> list[torch.Tensor]:
        """One clip's input_features [windows, n_mels, frames] and its windows' frame mask [windows, frames] -> one
        [tokens, hidden] tensor: each window's valid states, pooled and projected, in order."""
        valid_frames = tensors[self.mask_name].sum(-1).tolist()  # [windows]
        rows = []
        for window, frames in zip(input_features, valid_frames):
            positions = (int(frames) - 1) // 2 + 1  # states after the stride-2 convolution
            states = self.audio_tower(window[None], num_positions=positions)  # [1, positions // 2, d_model]
            rows.append(self.multi_modal_projector(states[0]))
        return [torch.cat(rows)]


class AudioFlamingo3ForConditionalGeneration(Qwen2AudioForConditionalGeneration):
    """AudioFlamingo3: Qwen2-Audio's encoder and decoder, LLaVA's two-layer MLP projector, long clips in windows."""

    mask_name = "input_features_mask"

    def build_projector(self, config: PretrainedConfig, prefix: str) -> nn.Module:
        """linear_1 (encoder width -> decoder width), `projector_hidden_act`, linear_2."""
        return MLPProjector(config.audio_config.d_model, config.text_config.hidden_size,
                            config.projector_hidden_act, bias=bool(config.projector_bias), prefix=prefix)
