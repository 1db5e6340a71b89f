"""PaliGemma (`PaliGemmaForConditionalGeneration`): LLaVA's layout with other blocks — a SigLIP ViT whose last
hidden state (post-norm applied) is projected by one linear layer, one token per patch, into a Gemma decoder. The
processor puts the image's placeholders first, then `<bos>`, the prompt and a newline.

The decoder is a prefix LM: every prompt token (the image's and the text's) attends to every other prompt token,
and the generated tokens causally (transformers' `token_type_ids` block over the prefix): `bidirectional_spans =
"prompt"`, so the scheduler runs each prompt whole in one step (a prompt longer than the step's budget is refused)
and prefix caching never ends inside it (layers/attention/spans.py). Positions are 1-indexed, as in transformers.
The text config's `use_bidirectional_attention` (PaliGemmaConfig sets it) is that prefix mask; PaliGemma 2 (a
Gemma 2 decoder, whose attention soft-caps) is not run.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.vision import LinearProjector, VisionTransformer, vit_config
from llmplug.plugins.models.gemma import GemmaForCausalLM
from llmplug.plugins.models.llava import LlavaForConditionalGeneration, maybe_prefix

__all__ = ["PaliGemmaForConditionalGeneration"]


class PaliGemmaForConditionalGeneration(LlavaForConditionalGeneration):
    """PaliGemma: SigLIP ViT -> linear projector -> image rows in the Gemma decoder's input embeddings, the prompt
    attending both ways (LLaVA's checkpoint layouts, weight routing, embedding and logits, inherited)."""

    language_models = {"gemma": GemmaForCausalLM}
    bidirectional_spans = "prompt"  # the whole prompt is one span (multimodal.bidirectional_spans)

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=_causal_decoder(config), prefix=prefix)

    @classmethod
    def batch_invariance_gap(cls, config: PretrainedConfig) -> str | None:
        """The Gemma decoder's."""
        return super().batch_invariance_gap(_causal_decoder(config))

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """A SigLIP ViT's last hidden state (post-norm) and the linear projector."""
        vision = vit_config(config.vision_config)
        tower = VisionTransformer(vision, None, prefix=maybe_prefix(prefix, "vision_tower"))
        projector = LinearProjector(vision.hidden_size, config.text_config.hidden_size,
                                    prefix=maybe_prefix(prefix, "multi_modal_projector"))
        return tower, projector

    def embed_multimodal(self, pixel_values: torch.Tensor, **_: Any) -> list[torch.Tensor]:
        """pixel_values [B, C, H, W] -> one [patches, hidden] tensor per image: its placeholder rows."""
        return list(self.multi_modal_projector(self.vision_tower(pixel_values)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As LLaVA's, at positions + 1 (PaliGemma's are 1-indexed)."""
        return super().forward(input_ids, positions + 1, intermediate_tensors, inputs_embeds)


def _causal_decoder(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of `config` whose decoder is causal: its `use_bidirectional_attention` is the prefix mask, which the
    prompt's span gives."""
    config = copy.deepcopy(config)
    config.text_config.use_bidirectional_attention = False
    return config
