"""InternVL (`InternVLForConditionalGeneration`, transformers' native InternVL: OpenGVLab/InternVL3-*-hf): LLaVA's
layout with other blocks — InternViT (the shared ViT's `internvl_vision` layout: layer scale, its own tensor names)
whose `vision_feature_layer` hidden states (the last by default) lose the class token, the shuffled MLP projector (each
2 x 2 block of patches one token for `downsample_ratio` 0.5, a LayerNorm, linear_1 -> GELU -> linear_2) and the
decoder of `text_config` (Qwen2 for InternVL3; Llama, Qwen3).

The processor (GotOcr2's image processor) splits an image into tiles plus a thumbnail (`crop_to_patches`) and
expands it into `<img>` + tiles x `image_seq_length` x `<IMG_CONTEXT>` + `</img>`: one run of placeholders per
image; an item's tensors are its tiles, pixel_values [tiles, C, H, W], projected tile by tile in the processor's order.

Checkpoints: LLaVA's layouts (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
`lm_head.*`), the tower under InternVLVisionModel's own names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError
from llmplug.layers.vision import ShuffledMLPProjector, VisionTransformer, vit_config
from llmplug.plugins.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from llmplug.plugins.models.llava import LlavaForConditionalGeneration, maybe_prefix

__all__ = ["InternVLForConditionalGeneration"]

PROJECTOR_EPS = 1e-5  # transformers' InternVLMultiModalProjector norm: nn.LayerNorm's default


class InternVLForConditionalGeneration(LlavaForConditionalGeneration):
    """InternVL: InternViT per tile -> pixel shuffle, LayerNorm, MLP -> image rows in the decoder's input embeddings
    (LLaVA's delegation and weight routing)."""

    language_models = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM}

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """InternViT's `vision_feature_layer` hidden states and the shuffled MLP projector."""
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is not "
                                 "'default' or 'full'")
        if not isinstance(config.vision_feature_layer, int):
            raise ModelLoadError(f"InternVL takes one vision_feature_layer, got {config.vision_feature_layer}")
        scale = round(1 / config.downsample_ratio)
        if scale * config.downsample_ratio != 1:
            raise ModelLoadError(f"downsample_ratio {config.downsample_ratio} is not 1 / an integer")
        self.drop_class_token = config.vision_feature_select_strategy == "default"
        layer = config.vision_feature_layer
        # transformers takes `last_hidden_state` for -1: post-normed without mean pooling (the norm is then built)
        feature_layer = None if layer == -1 and not config.vision_config.use_mean_pooling else layer
        vision = vit_config(config.vision_config)
        tower = VisionTransformer(vision, feature_layer, prefix=maybe_prefix(prefix, "vision_tower"))
        projector = ShuffledMLPProjector(
            vision.hidden_size, config.text_config.hidden_size, scale, PROJECTOR_EPS, config.projector_hidden_act,
            prefix=maybe_prefix(prefix, "multi_modal_projector"))
        return tower, projector

    def embed_multimodal(self, pixel_values: torch.Tensor, **_: Any) -> list[torch.Tensor]:
        """pixel_values [tiles, C, H, W] (one image's tiles, the thumbnail last) -> one [tiles * tokens_per_tile,
        hidden] tensor: its placeholder rows, tile by tile."""
        return [self.encode_images(pixel_values).flatten(0, 1)]
