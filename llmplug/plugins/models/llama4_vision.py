"""Llama 4 with images (`Llama4ForConditionalGeneration`: Llama 4 Scout / Maverick): LLaVA's layout with Llama 4's
blocks — its ViT (the shared ViT's `llama4_vision_model` layout: class token after the patches, a 2D rotary over
the patch grid, pre- and post-LayerNorm), whose last hidden state less the class token goes through the vision
adapter (the shuffled MLP projector without norm or biases: each 2 x 2 block of patches one token for
`pixel_shuffle_ratio` 0.5, fc1 -> GELU -> fc2 -> GELU), then the bias-free `multi_modal_projector.linear_1`, into
the Llama 4 text decoder (`llama4_text`: MoE, chunked attention, NoPE layers).

The processor (Llama4Processor) resizes an image onto the best-fitting canvas of up to `max_patches` tiles, splits
it into tiles and, when there are several, adds the whole image as a global tile; it expands the image into
`<|image_start|>`, each tile's `<|patch|>` run (tiles of a row joined by `<|tile_x_separator|>`, rows ended by
`<|tile_y_separator|>`), then `<|image|>`, the global tile's run and `<|image_end|>` — several runs per image, one
item with an `is_embed` mask over its span. An item's tensors: pixel_values [tiles, C, H, W], the global tile last,
encoded tile by tile in that order.

Checkpoints: transformers' names (`vision_model.*`, its adapter `vision_model.vision_adapter.mlp.*`,
`multi_modal_projector.linear_1.*`, `language_model.model.*`, `language_model.lm_head.*`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError
from llmplug.layers.vision import LinearProjector, ShuffledMLPProjector, VisionTransformer, vit_config
from llmplug.plugins.models.llama4 import Llama4ForCausalLM
from llmplug.plugins.models.llava import LlavaForConditionalGeneration, maybe_prefix

__all__ = ["Llama4ForConditionalGeneration"]

# checkpoint prefix -> (our submodule, the prefix its own load_weights expects); the longest match wins
CHECKPOINT_PREFIXES: dict[str, tuple[str, str]] = {
    "language_model.model.": ("language_model", "model."),
    "language_model.lm_head.": ("language_model", "lm_head."),
    "vision_model.": ("vision_tower", ""),
    "vision_model.vision_adapter.mlp.fc1.": ("vision_adapter", "linear_1."),
    "vision_model.vision_adapter.mlp.fc2.": ("vision_adapter", "linear_2."),
    "multi_modal_projector.linear_1.": ("multi_modal_projector", "linear."),
}


class Llama4ForConditionalGeneration(LlavaForConditionalGeneration):
    """Llama 4: its ViT per tile -> pixel-shuffle MLP adapter -> linear projector -> image rows in the Llama 4
    decoder's input embeddings (LLaVA's delegation and weight routing)."""

    language_models = {"llama4_text": Llama4ForCausalLM}
    checkpoint_prefixes = CHECKPOINT_PREFIXES

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """The ViT (its last hidden state, post-normed), the vision adapter and the linear projector."""
        vision_hf = config.vision_config
        scale = round(1 / vision_hf.pixel_shuffle_ratio)
        vision = vit_config(vision_hf)
        folded = vision.hidden_size * scale**2
        if scale * vision_hf.pixel_shuffle_ratio != 1:
            raise ModelLoadError(f"pixel_shuffle_ratio {vision_hf.pixel_shuffle_ratio} is not 1 / an integer")
        if vision_hf.intermediate_size != folded or vision_hf.projector_input_dim != vision_hf.projector_output_dim:
            raise ModelLoadError(
                f"Llama 4's vision adapter takes the pixel-shuffled patches ({folded} features) as intermediate_size "
                f"({vision_hf.intermediate_size}) features and needs projector_input_dim == projector_output_dim "
                f"({vision_hf.projector_input_dim}, {vision_hf.projector_output_dim}), as transformers builds it")
        tower = VisionTransformer(vision, prefix=maybe_prefix(prefix, "vision_tower"))
        self.vision_adapter = ShuffledMLPProjector(
            vision.hidden_size, vision_hf.projector_output_dim, scale, None, "gelu",
            intermediate_size=vision_hf.projector_input_dim, prefix=maybe_prefix(prefix, "vision_adapter"),
            bias=False, output_activation=True)
        projector = LinearProjector(vision_hf.vision_output_dim, config.text_config.hidden_size,
                                    prefix=maybe_prefix(prefix, "multi_modal_projector"), bias=False)
        return tower, projector

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [tiles, C, H, W] -> [tiles, tokens_per_tile, hidden] (the class token, last, dropped)."""
        features = self.vision_tower(pixel_values)[:, :-1]  # [tiles, patches, vision_hidden]
        return self.multi_modal_projector(self.vision_adapter(features))

    def embed_multimodal(self, pixel_values: torch.Tensor, **_: Any) -> list[torch.Tensor]:
        """pixel_values [tiles, C, H, W] (one image's tiles, the global tile last) -> one [tiles * tokens_per_tile,
        hidden] tensor: its placeholder rows, tile by tile."""
        return [self.encode_images(pixel_values).flatten(0, 1)]
