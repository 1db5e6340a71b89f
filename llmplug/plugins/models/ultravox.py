"""Ultravox (fixie-ai; `UltravoxModel`, model_type "ultravox"): a language family that exists (Llama, Mistral,
Qwen2, Qwen3, as `text_config` says) plus the Whisper encoder block (layers/audio), unpooled, and the stacking
projector (layers/audio/stacking_projector.py). Each clip is one run of `audio_token_index` placeholders:
ceil(frames / 16) per 30 s window with stack_factor 8.

transformers has no Ultravox classes (its checkpoints bring theirs as remote code), so the family brings its
config (`UltravoxConfig`, what the loader reads config.json with) and processing (ultravox_processing.py, what the
engine runs prompts through). The encoder runs on each window's valid frames alone (Ultravox's modified Whisper
encoder takes fewer than 3000 frames, its positions cut to match): a clip is encoded the same whatever else the
prompt holds. Checkpoint names are Ultravox's: `audio_tower.*` (transformers' WhisperEncoder names),
`multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import CONFIG_MAPPING, PretrainedConfig

from llmplug.core.errors import ModelLoadError
from llmplug.layers.audio import WhisperEncoder, whisper_encoder_config
from llmplug.layers.activation import ACTIVATIONS
from llmplug.layers.audio.stacking_projector import SWIGLU, StackingProjector, StackingProjectorConfig
from llmplug.layers.decoder import DecoderForCausalLM
from llmplug.plugins.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from llmplug.plugins.models.llava import LlavaForConditionalGeneration, maybe_prefix
from llmplug.plugins.models.ultravox_processing import UltravoxProcessor

__all__ = ["UltravoxConfig", "UltravoxModel"]

# text_config.model_type -> the decoder family that runs it
LANGUAGE_MODELS: dict[str, type[DecoderForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}

# checkpoint prefix -> (our submodule, the prefix its own load_weights expects)
CHECKPOINT_PREFIXES: dict[str, tuple[str, str]] = {
    "language_model.model.": ("language_model", "model."),
    "language_model.lm_head.": ("language_model", "lm_head."),
    "audio_tower.": ("audio_tower", ""),
    "multi_modal_projector.": ("multi_modal_projector", ""),
}


def _sub_config(value: dict[str, Any] | PretrainedConfig | None, default_type: str) -> PretrainedConfig | None:
    if value is None or isinstance(value, PretrainedConfig):
        return value
    return CONFIG_MAPPING[value.get("model_type", default_type)](**value)


class UltravoxConfig(PretrainedConfig):
    """Ultravox's config.json: `audio_config` (a WhisperConfig), `text_config` (the decoder's), the projector's
    `hidden_size`, `stack_factor`, `projector_act`, `projector_ln_mid`, `norm_init`, and `audio_token_index`.
    Fields as fixie-ai's UltravoxConfig names them; `audio_model_id` / `text_model_id` name the towers' repositories
    instead of their configs (the model refuses those: their weights are not in the folder)."""

    model_type = "ultravox"

    def __init__(self, audio_config: dict[str, Any] | PretrainedConfig | None = None,
                 text_config: dict[str, Any] | PretrainedConfig | None = None, audio_model_id: str | None = None,
                 text_model_id: str | None = None, audio_token_index: int | None = None, hidden_size: int = 4096,
                 stack_factor: int = 8, norm_init: float = 0.4, projector_act: str = "swiglu",
                 projector_ln_mid: bool = False, num_projector_layers: int = 0, **kwargs: Any) -> None:
        self.audio_config = _sub_config(audio_config if audio_model_id is None else None, "whisper")
        self.text_config = _sub_config(text_config if text_model_id is None else None, "llama")
        self.audio_model_id, self.text_model_id = audio_model_id, text_model_id
        self.audio_token_index = audio_token_index
        self.hidden_size, self.stack_factor, self.norm_init = hidden_size, stack_factor, norm_init
        self.projector_act, self.projector_ln_mid = projector_act, projector_ln_mid
        self.num_projector_layers = num_projector_layers
        if self.text_config is not None:
            kwargs.setdefault("vocab_size", self.text_config.vocab_size)
        super().__init__(**kwargs)


def _check_supported(config: PretrainedConfig) -> None:
    """ModelLoadError naming what an Ultravox config asks for that this family does not run."""
    for field in ("audio_model_id", "text_model_id"):
        if getattr(config, field) is not None:
            raise ModelLoadError(
                f"the Ultravox config names {field}={getattr(config, field)!r}: that tower's config and weights live "
                f"in another repository, which llmplug does not load; save a folder holding them (config.json with "
                f"{'audio_config' if field == 'audio_model_id' else 'text_config'}, and the tower's tensors under "
                f"{'audio_tower.' if field == 'audio_model_id' else 'language_model.'})")
    if config.num_projector_layers:
        raise ModelLoadError(f"num_projector_layers={config.num_projector_layers}: Ultravox's transformer projector "
                             "is not supported; the feed-forward one (num_projector_layers 0) is")
    if config.projector_act != SWIGLU and config.projector_act not in ACTIVATIONS:
        raise ModelLoadError(f"projector_act={config.projector_act!r} is not supported; supported: "
                             f"{sorted([SWIGLU, *ACTIVATIONS])}")
    if config.audio_token_index is None:
        raise ModelLoadError("the Ultravox config has no audio_token_index (the <|audio|> placeholder's token id)")


class UltravoxModel(LlavaForConditionalGeneration):
    """Ultravox: Whisper encoder -> stacking projector -> clip rows in the decoder's input embeddings (LLaVA's weight
    routing, embedding, forward and logits, inherited)."""

    # the encoder's layers shard as the ViT's (heads and MLP), its convolutions and positions replicated; the
    # projector is replicated; each rank encodes whole clips
    supports_tensor_parallel = True
    language_models = LANGUAGE_MODELS
    checkpoint_prefixes = CHECKPOINT_PREFIXES
    hf_config_class = UltravoxConfig  # transformers knows no "ultravox" config: the loader reads config.json with it

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        # LLaVA's __init__ builds a vision tower and reads image_token_id: an audio model has neither
        nn.Module.__init__(self)
        _check_supported(config)
        self.config = config
        self.audio_token_id = int(config.audio_token_index)
        self.audio_tower = WhisperEncoder(whisper_encoder_config(config.audio_config),
                                          prefix=maybe_prefix(prefix, "audio_tower"))
        projector = StackingProjectorConfig(
            encoder_hidden=config.audio_config.d_model, text_hidden=config.text_config.hidden_size,
            hidden_size=config.hidden_size, stack_factor=config.stack_factor, activation=config.projector_act,
            norm_mid=bool(config.projector_ln_mid))
        self.multi_modal_projector = StackingProjector(projector, prefix=maybe_prefix(prefix, "multi_modal_projector"))
        text_config = config.text_config
        self.language_model = self.language_model_class(text_config)(config=text_config,
                                                                      prefix=maybe_prefix(prefix, "language_model"))

    @classmethod
    def batch_invariance_gap(cls, config: PretrainedConfig) -> str | None:
        """The language model's (asked before any worker starts: an unsupported config is refused here first)."""
        _check_supported(config)
        return super().batch_invariance_gap(config)

    @classmethod
    def build_hf_processor(cls, model_path: str, config: PretrainedConfig) -> UltravoxProcessor:
        """The processing the engine runs this family's prompts through (transformers has none for it)."""
        return UltravoxProcessor.from_pretrained(model_path, config)

    def embed_multimodal(self, input_features: torch.Tensor, audio_lens: torch.Tensor,
                         **_: Any) -> list[torch.Tensor]:
        """One clip's windows [windows, n_mels, window frames] and their valid frames [windows] -> one [tokens,
        hidden] tensor: each window's valid frames encoded, stacked and projected, in order."""
        rows = []
        for window, frames in zip(input_features, audio_lens.tolist()):
            states = self.audio_tower(window[None, :, : int(frames)])  # [1, ceil(frames / 2), d_model]
            rows.append(self.multi_modal_projector(states[0]))  # [ceil(frames / 16), hidden]
        return [torch.cat(rows)]
