"""Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): one family
in two rows. The Qwen2 decoder of `text_config` with multimodal rotary positions (layers/mrope.py: its
`rope_parameters.mrope_section`), the Qwen2-VL vision tower and the patch merger (layers/vision/qwen_vit.py); the
two rows differ only in their vision configs' data (norms, MLP, windowed attention).

The processor resizes each image to a multiple of `patch_size * spatial_merge_size`, cuts it into patches
(pixel_values [patches, C * T * P * P], all of a prompt's images in one tensor; `image_grid_thw` [images, 3]) and
expands each `<|image_pad|>` into one placeholder per merge block; an item's tensors are its own patches and grid.
Each image's tokens take M-RoPE positions from its grid (`get_mrope_input_positions`, which the model runner calls
once per request).

Checkpoints: the original layout (`model.*`, `visual.*`, `lm_head.*`, which transformers 5 still saves) and
transformers 5's in-memory one (`model.language_model.*`, `model.visual.*`).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.mrope import mrope_input_positions
from llmplug.layers.vision import PatchMerger, QwenVisionTransformer, qwen_vit_config
from llmplug.plugins.models.llama import Qwen2ForCausalLM
from llmplug.plugins.models.llava import LlavaForConditionalGeneration, maybe_prefix

__all__ = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"]


class Qwen2VLForConditionalGeneration(LlavaForConditionalGeneration):
    """Qwen2-VL: Qwen ViT -> patch merger -> image rows in the M-RoPE Qwen2 decoder's input embeddings (LLaVA's
    delegation and weight routing, with its own blocks and checkpoint names)."""

    supports_tensor_parallel = True  # the tower and the merger shard like the decoder; each rank encodes whole
    language_models = {"qwen2_vl_text": Qwen2ForCausalLM, "qwen2_5_vl_text": Qwen2ForCausalLM}
    checkpoint_prefixes = {
        "model.language_model.": ("language_model", "model."),
        "model.": ("language_model", "model."),
        "lm_head.": ("language_model", "lm_head."),
        "model.visual.merger.": ("multi_modal_projector", ""),
        "visual.merger.": ("multi_modal_projector", ""),
        "model.visual.": ("vision_tower", ""),
        "visual.": ("vision_tower", ""),
    }

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        # the text config does not carry the checkpoint's tying (the top-level config does): its own copy that does
        config = copy.copy(config)
        config.text_config = copy.copy(config.text_config)
        config.text_config.tie_word_embeddings = bool(config.tie_word_embeddings)
        super().__init__(config=config, prefix=prefix)
        self.spatial_merge_size = int(config.vision_config.spatial_merge_size)

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """The Qwen ViT and the patch merger into the decoder's width."""
        vision = qwen_vit_config(config.vision_config)
        tower = QwenVisionTransformer(vision, prefix=maybe_prefix(prefix, "vision_tower"))
        merger = PatchMerger(vision.hidden_size, vision.out_hidden_size, vision.spatial_merge_size, vision.norm,
                             prefix=maybe_prefix(prefix, "multi_modal_projector"))
        return tower, merger

    def embed_multimodal(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                         **_: Any) -> list[torch.Tensor]:
        """pixel_values [patches, C * T * P * P] and image_grid_thw [1, 3] of one image -> one [patches / merge**2,
        hidden] tensor: its placeholder rows."""
        states, _ = self.vision_tower(pixel_values, image_grid_thw)
        return [self.multi_modal_projector(states)]

    def get_mrope_input_positions(self, prompt_token_ids: Sequence[int],
                                  mm_features: Sequence[Any]) -> tuple[np.ndarray, int]:
        """(M-RoPE positions [3, prompt length], delta of the positions after the prompt) of a prompt whose images
        are `mm_features`: each image's tokens at its grid of merge blocks."""
        m = self.spatial_merge_size
        grids = []
        for feature in mm_features:
            t, h, w = (int(n) for n in feature.data["image_grid_thw"][0])
            grids.append((feature.offset, feature.length, (t, h // m, w // m)))
        return mrope_input_positions(len(prompt_token_ids), grids)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL with RMSNorm, a SwiGLU MLP and windowed attention in the tower (its vision config's
    data)."""
