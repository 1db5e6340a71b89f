"""Aya Vision (`AyaVisionForConditionalGeneration`, CohereLabs/aya-vision-*): LLaVA's layout with other blocks — a
SigLIP ViT's `vision_feature_layer` hidden states (the last layer's by default, not post-normed), the shuffled MLP
projector (each `downsample_factor` x `downsample_factor` block of patches one token, a LayerNorm, then a SwiGLU over
`linear_1`'s halves and `linear_2`) and the Cohere 2 decoder (Command R7B; Cohere for the older checkpoints).

The processor (GotOcr2's image processor) splits an image into tiles plus a global view (`crop_to_patches`), each
tile `<tile tag>` + `(img_size / patch_size)**2` x `<|IMG_PATCH|>` between `<|START_OF_IMG|>` and `<|END_OF_IMG|>`;
an item's tensors are its tiles, pixel_values [tiles, C, H, W], projected tile by tile in the processor's order.

Checkpoints: LLaVA's two layouts, the projector's norm saved as `multi_modal_projector.layernorm`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError
from llmplug.layers.vision import ShuffledMLPProjector, VisionTransformer, vit_config
from llmplug.plugins.models.cohere import Cohere2ForCausalLM, CohereForCausalLM
from llmplug.plugins.models.llava import CHECKPOINT_PREFIXES, LlavaForConditionalGeneration, maybe_prefix

__all__ = ["AyaVisionForConditionalGeneration"]


class AyaVisionForConditionalGeneration(LlavaForConditionalGeneration):
    """Aya Vision: SigLIP ViT per tile -> pixel shuffle, LayerNorm, SwiGLU projector -> image rows in the Cohere 2
    decoder's input embeddings (LLaVA's delegation and weight routing)."""

    language_models = {"cohere2": Cohere2ForCausalLM, "cohere": CohereForCausalLM}
    checkpoint_prefixes = {
        **CHECKPOINT_PREFIXES,
        "model.multi_modal_projector.layernorm.": ("multi_modal_projector", "layer_norm."),
        "multi_modal_projector.layernorm.": ("multi_modal_projector", "layer_norm."),
    }

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """The ViT's `vision_feature_layer` hidden states and the gated shuffled projector."""
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is not "
                                 "'default' or 'full'")
        self.drop_class_token = config.vision_feature_select_strategy == "default"
        layer = config.vision_feature_layer
        vision = vit_config(config.vision_config)
        tower = VisionTransformer(vision, layer if isinstance(layer, int) else tuple(layer),
                                  prefix=maybe_prefix(prefix, "vision_tower"))
        num_layers = 1 if isinstance(layer, int) else len(layer)
        text_hidden = config.text_config.hidden_size
        # an optional field of the checkpoints' configs (transformers reads it the same way): the text width when absent
        intermediate = getattr(config, "alignment_intermediate_size", text_hidden)
        projector = ShuffledMLPProjector(
            vision.hidden_size * num_layers, text_hidden, int(config.downsample_factor),
            config.adapter_layer_norm_eps, gated=True, intermediate_size=intermediate,
            prefix=maybe_prefix(prefix, "multi_modal_projector"))
        return tower, projector

    def embed_multimodal(self, pixel_values: torch.Tensor, **_: Any) -> list[torch.Tensor]:
        """pixel_values [tiles, C, H, W] (one image's tiles, the global view last) -> one [tiles * tokens_per_tile,
        hidden] tensor: its placeholder rows, tile by tile."""
        return [self.encode_images(pixel_values).flatten(0, 1)]
