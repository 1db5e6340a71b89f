"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): LLaVA's layout with other blocks — a SigLIP ViT whose
last hidden state (post-norm applied) is average-pooled to `mm_tokens_per_image` rows by the Gemma 3 projector,
and the Gemma 3 text decoder. Each image is one run of `image_token_id` placeholders between the processor's
`<start_of_image>` and `<end_of_image>` tokens; the image rows are not scaled by sqrt(hidden) as the text
embeddings are (as in transformers).

The tokens of each image attend to one another both ways at prefill, as transformers' `token_type_ids` block mask
makes them (`bidirectional_spans = "image"`: layers/attention/spans.py; the scheduler never splits an image across
prefill chunks). Pan-and-scan crops (several pixel rows per image) are refused when processing; the processor's
default is off.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.vision import PooledProjector, VisionTransformer, vit_config
from llmplug.plugins.models.gemma import Gemma3ForCausalLM
from llmplug.plugins.models.llava import LlavaForConditionalGeneration, maybe_prefix

__all__ = ["Gemma3ForConditionalGeneration"]


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration):
    """Gemma 3: SigLIP ViT -> pooled projector -> image rows in the Gemma 3 decoder's input embeddings (LLaVA's
    checkpoint layouts, weight routing, embedding and logits, inherited)."""

    language_models = {"gemma3_text": Gemma3ForCausalLM}
    bidirectional_spans = "image"  # each image's tokens see one another (multimodal.bidirectional_spans)

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """A SigLIP ViT's last hidden state (post-norm) and the pooled projector."""
        vision = vit_config(config.vision_config)
        tower = VisionTransformer(vision, None, prefix=maybe_prefix(prefix, "vision_tower"))
        projector = PooledProjector(
            vision.hidden_size, config.text_config.hidden_size, vision.grid_size, config.mm_tokens_per_image,
            vision.eps, prefix=maybe_prefix(prefix, "multi_modal_projector"),
        )
        return tower, projector

    def embed_multimodal(self, pixel_values: torch.Tensor, **_: Any) -> list[torch.Tensor]:
        """pixel_values [B, C, H, W] -> one [mm_tokens_per_image, hidden] tensor per image: its placeholder rows."""
        features = self.vision_tower(pixel_values)  # [B, patches, vision_hidden], post-normed
        return list(self.multi_modal_projector(features))  # B x [mm_tokens_per_image, hidden]
