"""Idefics3 (`Idefics3ForConditionalGeneration`, HuggingFaceM4/Idefics3) and SmolVLM (`SmolVLMForConditionalGeneration`,
HuggingFaceTB/SmolVLM-*): one family in two rows. A language family that exists (the generic decoder of `text_config`,
Llama) plus the shared vision blocks: a SigLIP-layout ViT with Idefics3's bucketed position ids (its last hidden
state, post-norm applied) and the pixel-shuffle connector (each `scale_factor` x `scale_factor` block of patches one
token, then a bias-free linear).

The processor splits an image into tiles of `max_image_size` plus a global view, each tile a full square, and expands
the image into `<fake_token_around_image><row_i_col_j>` + `image_seq_len` x `<image>` per tile and the global view's
`<global-img>` run: one image is several runs of placeholders with tags between them, which the engine keeps as one
item with an `is_embed` mask over its span (engine/multimodal.py). An item's tensors are its tiles:
pixel_values [1, tiles, C, H, W] and pixel_attention_mask [1, tiles, H, W].

Checkpoints: `model.vision_model.*`, `model.connector.*`, `model.text_model.*`, `lm_head.*` (transformers 4.46+ and 5).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError
from llmplug.layers.decoder import DecoderForCausalLM
from llmplug.layers.vision import PixelShuffleConnector, VisionTransformer, vit_config
from llmplug.plugins.models.llama import LlamaForCausalLM

__all__ = ["Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"]

# text_config.model_type -> the decoder family that runs it (both families ship Llama decoders)
LANGUAGE_MODELS: dict[str, type[DecoderForCausalLM]] = {"llama": LlamaForCausalLM}

# checkpoint prefix -> (our submodule, the prefix its own load_weights expects)
CHECKPOINT_PREFIXES: dict[str, tuple[str, str]] = {
    "model.text_model.": ("language_model", "model."),
    "lm_head.": ("language_model", "lm_head."),
    "model.vision_model.": ("vision_model", ""),
    "model.connector.": ("connector", ""),
}


def _language_model_class(text_config: PretrainedConfig) -> type[DecoderForCausalLM]:
    cls = LANGUAGE_MODELS.get(text_config.model_type)
    if cls is None:
        raise ModelLoadError(f"Idefics3 / SmolVLM with a {text_config.model_type!r} language model is not supported; "
                             f"known: {sorted(LANGUAGE_MODELS)}")
    return cls


class Idefics3ForConditionalGeneration(nn.Module):
    """Idefics3: bucketed-position SigLIP ViT per tile -> pixel shuffle + linear -> image rows in the decoder input."""

    supports_multimodal = True  # embed_multimodal(**processor tensors of one item) -> one [tokens, hidden] per item
    supports_prompt_embeds = True
    supports_tensor_parallel = True  # the ViT shards like the decoder; the connector is replicated
    supports_pipeline_parallel = False
    supports_int4 = False  # not proven with the vision tower's layers

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.image_token_id = int(config.image_token_id)
        vision = vit_config(config.vision_config)
        self.patch_size = vision.patch_size
        self.vision_model = VisionTransformer(vision, prefix=_join(prefix, "vision_model"))
        self.connector = PixelShuffleConnector(vision.hidden_size, config.text_config.hidden_size,
                                               int(config.scale_factor), prefix=_join(prefix, "connector"))
        cls = _language_model_class(config.text_config)
        self.language_model = cls(config=config.text_config, prefix=_join(prefix, "language_model"))

    @classmethod
    def batch_invariance_gap(cls, config: PretrainedConfig) -> str | None:
        """The language model's (each image is encoded alone, so its rows never depend on the batch)."""
        return _language_model_class(config.text_config).batch_invariance_gap(config.text_config)

    @property
    def embedding_size(self) -> int:
        """Columns of the input embeddings (and of each image's rows)."""
        return self.language_model.embedding_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, hidden]."""
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None,
                         **_: Any) -> list[torch.Tensor]:
        """pixel_values [1, tiles, C, H, W] (one image's tiles) -> one [tiles * tokens_per_tile, hidden] tensor: its
        placeholder rows, tile by tile in the processor's order (the global view last)."""
        tiles = pixel_values.flatten(0, 1)  # [tiles, C, H, W]
        if pixel_attention_mask is not None and not bool(pixel_attention_mask.all()):
            # the processor pads only when a batch mixes sizes; one image's tiles are full squares
            raise ValueError(f"{type(self).__name__} encodes full tiles only; this image's tiles carry padding "
                             "(pixel_attention_mask has zeros)")
        features = self.connector(self.vision_model(tiles))  # [tiles, tokens_per_tile, hidden]
        return [features.flatten(0, 1)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]; the model runner puts the image rows in
        `inputs_embeds` at their placeholders."""
        return self.language_model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.language_model.compute_logits(hidden_states, sampling_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route each checkpoint tensor to its part; returns the loaded parameter names."""
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {name: [] for name, _ in CHECKPOINT_PREFIXES.values()}
        unknown = []
        for name, tensor in weights:
            match = next((p for p in CHECKPOINT_PREFIXES if name.startswith(p)), None)
            if match is None:
                unknown.append(name)
                continue
            part, inner = CHECKPOINT_PREFIXES[match]
            parts[part].append((inner + name[len(match):], tensor))
        if unknown:
            raise ModelLoadError(f"{type(self).__name__} checkpoint tensors outside its text model, vision model and "
                                 f"connector: {unknown[:8]}")
        loaded = set()
        for part, part_weights in parts.items():
            loaded |= {f"{part}.{name}" for name in getattr(self, part).load_weights(part_weights)}
        return loaded


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM: Idefics3's model as it is (its differences are in the processor's video handling and the configs'
    defaults: `smolvlm_vision`, a larger scale factor)."""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
