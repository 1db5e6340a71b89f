"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): LLaVA's layout with other blocks — a SigLIP ViT whose
last hidden state (post-norm applied) is average-pooled to `mm_tokens_per_image` rows by the Gemma 3 projector,
and the Gemma 3 text decoder. Each image is one run of `image_token_id` placeholders between the processor's
`<start_of_image>` and `<end_of_image>` tokens; the image rows are not scaled by sqrt(hidden) as the text
embeddings are (as in transformers).

Pan-and-scan (the processor's `do_pan_and_scan`, through `mm_processor_kwargs`) adds crops of a wide or tall image:
the image is then one item whose pixel rows are the whole picture and each crop, each its own run of placeholders
with the processor's text between them (`is_embed` marks the runs), and its encoder rows are theirs in that order.

The tokens of each run attend to one another both ways at prefill, as transformers' `token_type_ids` block mask
makes them (`bidirectional_spans = "image"`: each run of consecutive image tokens, never the text between crops;
layers/attention/spans.py; the scheduler never splits a run across prefill chunks).
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
        """One image's pixel_values [1 + crops, C, H, W] (the picture, then its pan-and-scan crops) -> its placeholder
        rows [(1 + crops) * mm_tokens_per_image, hidden], the picture's first."""
        features = self.vision_tower(pixel_values)  # [1 + crops, patches, vision_hidden], post-normed
        rows = self.multi_modal_projector(features)  # [1 + crops, mm_tokens_per_image, hidden]
        return [rows.flatten(0, 1)]
