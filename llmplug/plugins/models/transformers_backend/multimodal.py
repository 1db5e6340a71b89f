"""A vision-language model through the transformers backend: transformers' own image-text-to-text class (what
`AutoModelForImageTextToText` builds), its vision tower and projector run by transformers (their own attention),
its language model on llmplug's paged attention.

The engine's multimodal path needs three things of it (docs/multimodal.md): `embed_multimodal` — one image's
processor tensors through the model's own `get_image_features`, its rows flattened to [tokens, hidden] as
transformers scatters them into the placeholders; `embed_input_ids` — the language model's input embeddings;
and `forward(..., inputs_embeds=)` — the language model on those rows. It runs families whose merge is exactly
that (image rows at the placeholder tokens, causal attention, 1-D positions); support.py refuses the others.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError
from llmplug.plugins.models.transformers_backend import attention
from llmplug.plugins.models.transformers_backend.base import TransformersModel, check_plain_head
from llmplug.plugins.models.transformers_backend.support import image_text_to_text_class, multimodal_unsupported_reason

__all__ = ["TransformersForMultimodalLM"]


class TransformersForMultimodalLM(TransformersModel):
    """Any transformers image-text-to-text model whose merge is image rows at its placeholder tokens."""

    supports_multimodal: ClassVar[bool] = True  # embed_multimodal(**one item's processor tensors) -> [[tokens, hidden]]
    supports_prompt_embeds: ClassVar[bool] = True
    supports_tensor_parallel: ClassVar[bool] = False  # the vision tower has no tensor-parallel plan to follow

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        check_plain_head(self.model)
        token = getattr(config, "image_token_id", None)
        token = getattr(config, "image_token_index", None) if token is None else token
        if token is None:
            raise ModelLoadError(f"{type(self.model).__name__}'s config names no image token (image_token_id or "
                                 "image_token_index)")
        self.image_token_id = int(token)
        if not callable(getattr(self.model, "get_image_features", None)):
            raise ModelLoadError(f"{type(self.model).__name__} has no get_image_features, which the transformers "
                                 "backend encodes images with")
        # what the image path takes by name: the outer class's and its inner model's (where image_sizes may be)
        inner = getattr(self.model.base_model, "get_image_features", None)
        self._image_arguments = _named_parameters(self.model.get_image_features) | (
            _named_parameters(inner) if inner is not None else frozenset())

    find_hf_class = staticmethod(image_text_to_text_class)
    hf_class_kind = "image-text-to-text model"

    @staticmethod
    def refusal(hf_class: type, config: PretrainedConfig) -> str | None:
        return multimodal_unsupported_reason(hf_class, config)

    @property
    def decoder(self) -> nn.Module:
        """The language model: only its attention runs paged (the vision tower's stays transformers')."""
        return self.model.get_decoder()

    def attn_implementation(self, config: PretrainedConfig) -> dict[str, str]:
        """llmplug's paged attention for the text sub-config only; the other parts keep transformers' default."""
        text = config.get_text_config()
        key = next((k for k in config.sub_configs if getattr(config, k, None) is text), None)
        if key is None:
            raise ModelLoadError(f"{type(config).__name__} has no sub-config holding its text config")
        return {key: attention.ATTN_IMPLEMENTATION}

    @property
    def embedding_size(self) -> int:
        """Columns of the input embeddings (and of each image's rows)."""
        return self.model.get_input_embeddings().embedding_dim

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, hidden] (the language model's, scaled as its own are)."""
        return self.model.get_input_embeddings()(input_ids)

    def embed_multimodal(self, **data: torch.Tensor) -> list[torch.Tensor]:
        """One image's processor tensors -> [its rows [tokens, hidden]], through the model's `get_image_features`
        (given the tensors it names: pixel_values, image_sizes, pixel_attention_mask, ...)."""
        if "pixel_values" not in data:
            raise ValueError(f"{type(self.model).__name__}.get_image_features needs pixel_values; the processor gave "
                             f"{sorted(data)}")
        out = self.model.get_image_features(**{k: v for k, v in data.items() if k in self._image_arguments})
        features = out.pooler_output if hasattr(out, "pooler_output") else out
        parts = features if isinstance(features, (list, tuple)) else [features]
        return [torch.cat([part.reshape(-1, part.shape[-1]) for part in parts])]  # [tokens, hidden]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]; the model runner puts the image rows in
        `inputs_embeds` at their placeholders."""
        return self._hidden_states(input_ids, positions, self.decoder, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]: lm_head, then the final soft-cap if the text config has one."""
        return self._logits(hidden_states)


def _named_parameters(function: Any) -> frozenset[str]:
    """The names `function` takes explicitly (not through **kwargs)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(name for name, p in inspect.signature(function).parameters.items() if p.kind in kinds)
