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

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.vision import PixelShuffleConnector, VisionTransformer, vit_config
from llmplug.plugins.models.llama import LlamaForCausalLM
from llmplug.plugins.models.llava import LlavaForConditionalGeneration, maybe_prefix

__all__ = ["Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"]


class Idefics3ForConditionalGeneration(LlavaForConditionalGeneration):
    """Idefics3: bucketed-position SigLIP ViT per tile -> pixel shuffle + linear -> image rows in the decoder input
    (LLaVA's delegation and weight routing, with its own blocks and checkpoint names)."""

    supports_tensor_parallel = True  # the ViT shards like the decoder; the connector is replicated
    language_models = {"llama": LlamaForCausalLM}  # both families ship Llama decoders
    checkpoint_prefixes = {
        "model.text_model.": ("language_model", "model."),
        "lm_head.": ("language_model", "lm_head."),
        "model.vision_model.": ("vision_tower", ""),
        "model.connector.": ("multi_modal_projector", ""),
    }

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """The ViT's last hidden state (post-norm) and the pixel-shuffle connector."""
        vision = vit_config(config.vision_config)
        tower = VisionTransformer(vision, prefix=maybe_prefix(prefix, "vision_tower"))
        connector = PixelShuffleConnector(vision.hidden_size, config.text_config.hidden_size, int(config.scale_factor),
                                          prefix=maybe_prefix(prefix, "multi_modal_projector"))
        return tower, connector

    def embed_multimodal(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None,
                         **_: Any) -> list[torch.Tensor]:
        """pixel_values [1, tiles, C, H, W] (one image's tiles) -> one [tiles * tokens_per_tile, hidden] tensor: its
        placeholder rows, tile by tile in the processor's order (the global view last)."""
        tiles = pixel_values.flatten(0, 1)  # [tiles, C, H, W]
        if pixel_attention_mask is not None and not bool(pixel_attention_mask.all()):
            # the processor pads only when a batch mixes sizes; one image's tiles are full squares
            raise ValueError(f"{type(self).__name__} encodes full tiles only; this image's tiles carry padding "
                             "(pixel_attention_mask has zeros)")
        features = self.multi_modal_projector(self.vision_tower(tiles))  # [tiles, tokens_per_tile, hidden]
        return [features.flatten(0, 1)]


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM: Idefics3's model as it is (its differences are in the processor's video handling and the configs'
    defaults: `smolvlm_vision`, a larger scale factor)."""
