"""Mistral 3 (`Mistral3ForConditionalGeneration`: Mistral Small 3.1 / 3.2, Ministral 3; Pixtral's tower): LLaVA's
layout with other blocks — the Pixtral encoder (each image at its own size, 2D rotary, block-diagonal attention;
layers/vision/pixtral_vit.py), whose last layer's states go through the patch-merger projector (RMSNorm, each
`spatial_merge_size` x `spatial_merge_size` block of patches one token, then a GELU MLP), and the decoder of
`text_config` (Mistral; Llama, Ministral 3).

The processor (PixtralProcessor) resizes an image to multiples of patch_size x spatial_merge_size (never square)
and expands it row by row: each row of merged patches a run of `[IMG]` ended by `[IMG_BREAK]`, the last by
`[IMG_END]` — several runs per image, which the engine keeps as one item with an `is_embed` mask over its span. An
item's tensors: pixel_values [1, C, H, W] padded to the prompt's largest image, image_sizes [1, 2] its own size.
The padding depends on the prompt's other images, so the same image in another prompt may get another content hash:
an encoder- or prefix-cache miss, never another answer (the padding is cropped before encoding).

Checkpoints: LLaVA's layouts (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
`lm_head.*`), the tower under PixtralVisionModel's names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError
from llmplug.layers.vision import PatchMergerProjector, PixtralVisionTransformer, pixtral_vit_config
from llmplug.plugins.models.llama import LlamaForCausalLM, Ministral3ForCausalLM, MistralForCausalLM
from llmplug.plugins.models.llava import LlavaForConditionalGeneration, maybe_prefix

__all__ = ["Mistral3ForConditionalGeneration"]


class Mistral3ForConditionalGeneration(LlavaForConditionalGeneration):
    """Mistral 3: Pixtral encoder over the images of a call -> patch merger and MLP per image -> image rows in the
    decoder's input embeddings (LLaVA's delegation and weight routing)."""

    language_models = {"mistral": MistralForCausalLM, "llama": LlamaForCausalLM, "ministral3": Ministral3ForCausalLM}

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """The Pixtral encoder (its last layer) and the patch-merger projector."""
        if config.vision_feature_layer != -1:
            raise ModelLoadError(f"Mistral 3 with vision_feature_layer {config.vision_feature_layer} is not supported; "
                                 "its checkpoints take the last layer (-1)")
        vision = pixtral_vit_config(config.vision_config)
        tower = PixtralVisionTransformer(vision, prefix=maybe_prefix(prefix, "vision_tower"))
        projector = PatchMergerProjector(
            vision.hidden_size, config.text_config.hidden_size, int(config.spatial_merge_size),
            config.text_config.rms_norm_eps, config.projector_hidden_act, bool(config.multimodal_projector_bias),
            prefix=maybe_prefix(prefix, "multi_modal_projector"))
        return tower, projector

    def embed_multimodal(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor,
                         **_: Any) -> list[torch.Tensor]:
        """pixel_values [B, C, H, W] (padded to the largest), image_sizes [B, 2] (height, width) -> one
        [rows * cols / merge_size**2, hidden] tensor per image: its placeholder rows, row-major."""
        sizes = [(int(h), int(w)) for h, w in image_sizes.tolist()]
        images = [pixel_values[i, :, :h, :w] for i, (h, w) in enumerate(sizes)]
        grids = [self.vision_tower.grid(h, w) for h, w in sizes]
        features = self.vision_tower(images).split([rows * cols for rows, cols in grids])  # B x [patches, hidden]
        return [self.multi_modal_projector(f, grid) for f, grid in zip(features, grids)]
