"""LLaVA 1.5 (`LlavaForConditionalGeneration`): a language family that exists (the generic decoder, as its
`text_config` says: Llama, Mistral, Qwen2) plus the shared vision blocks — a CLIP ViT whose `vision_feature_layer`
hidden states (-2 by default) are taken, less the class token under the "default" `vision_feature_select_strategy`,
and the two-layer GELU MLP projector. One image is one run of `image_token_index` placeholders, one per patch.

Checkpoints come in transformers 5's layout (`model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*`, `lm_head.*`) and the older one (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`, which transformers still saves).

LLaVA-NeXT (`LlavaNextForConditionalGeneration`, llava-v1.6) is LLaVA 1.5 with any-resolution images: each image
comes as a base tile plus the tiles of a grid chosen from `image_grid_pinpoints`, all encoded and projected alike,
then packed with a learned `image_newline` row after each row of the tiles' feature map (layers/vision/anyres.py).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError
from llmplug.layers.decoder import DecoderForCausalLM
from llmplug.layers.vision import AnyResGrid, MLPProjector, VisionTransformer, vit_config
from llmplug.plugins.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

__all__ = ["LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"]

# text_config.model_type -> the decoder family that runs it
LANGUAGE_MODELS: dict[str, type[DecoderForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}

# checkpoint prefix -> (our submodule, the prefix its own load_weights expects); the longest match wins
CHECKPOINT_PREFIXES: dict[str, tuple[str, str]] = {
    "model.language_model.": ("language_model", "model."),
    "language_model.model.": ("language_model", "model."),
    "language_model.lm_head.": ("language_model", "lm_head."),
    "lm_head.": ("language_model", "lm_head."),
    "model.vision_tower.": ("vision_tower", ""),
    "vision_tower.": ("vision_tower", ""),
    "model.multi_modal_projector.": ("multi_modal_projector", ""),
    "multi_modal_projector.": ("multi_modal_projector", ""),
}


class LlavaForConditionalGeneration(nn.Module):
    """LLaVA 1.5: CLIP ViT -> MLP projector -> image rows in the decoder's input embeddings."""

    supports_multimodal = True  # embed_multimodal(**processor tensors of one item) -> one [tokens, hidden] per item
    supports_prompt_embeds = True
    supports_tensor_parallel = True  # the ViT and the projector shard like the decoder; each rank encodes whole
    supports_pipeline_parallel = False
    supports_int4 = False  # not proven with the vision tower's layers
    # the family's data: text_config.model_type -> decoder family; checkpoint prefix -> (part, its inner prefix)
    language_models: dict[str, type[DecoderForCausalLM]] = LANGUAGE_MODELS
    checkpoint_prefixes: dict[str, tuple[str, str]] = CHECKPOINT_PREFIXES

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.image_token_id = int(config.image_token_id)
        self.vision_tower, self.multi_modal_projector = self.build_vision(config, prefix)
        text_config = config.text_config
        self.language_model = self.language_model_class(text_config)(config=text_config,
                                                                      prefix=maybe_prefix(prefix, "language_model"))

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """The vision tower and the projector: a CLIP ViT's `vision_feature_layer` and the MLP projector."""
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} is not "
                                 "'default' or 'full'")
        self.drop_class_token = config.vision_feature_select_strategy == "default"
        layer = config.vision_feature_layer
        feature_layer = layer if isinstance(layer, int) else tuple(layer)
        vision = vit_config(config.vision_config)
        tower = VisionTransformer(vision, feature_layer, prefix=maybe_prefix(prefix, "vision_tower"))
        num_layers = 1 if isinstance(layer, int) else len(layer)
        projector = MLPProjector(
            vision.hidden_size * num_layers, config.text_config.hidden_size, config.projector_hidden_act,
            bias=bool(config.multimodal_projector_bias),
            prefix=maybe_prefix(prefix, "multi_modal_projector"))
        return tower, projector

    @classmethod
    def language_model_class(cls, text_config: PretrainedConfig) -> type[DecoderForCausalLM]:
        """The decoder family that runs `text_config` (`language_models`)."""
        family = cls.language_models.get(text_config.model_type)
        if family is None:
            raise ModelLoadError(f"{cls.__name__} with a {text_config.model_type!r} language model is not supported; "
                                 f"known: {sorted(cls.language_models)}")
        return family

    @classmethod
    def batch_invariance_gap(cls, config: PretrainedConfig) -> str | None:
        """The language model's (each image is encoded alone, so its rows never depend on the batch)."""
        return cls.language_model_class(config.text_config).batch_invariance_gap(config.text_config)

    @property
    def embedding_size(self) -> int:
        """Columns of the input embeddings (and of each image's rows)."""
        return self.language_model.embedding_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, hidden]."""
        return self.language_model.embed_input_ids(input_ids)

    def embed_multimodal(self, pixel_values: torch.Tensor, **_: Any) -> list[torch.Tensor]:
        """pixel_values [B, C, H, W] -> one [patches, hidden] tensor per image: its placeholder rows."""
        return list(self.encode_images(pixel_values))  # B x [patches, hidden]

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, H, W] -> projected patch features [B, patches, hidden] (class token dropped)."""
        features = self.vision_tower(pixel_values)  # [B, 1 + patches, vision_hidden * feature layers]
        if self.drop_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]; the model runner puts the image rows in
        `inputs_embeds` at their placeholders."""
        return self.language_model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.language_model.compute_logits(hidden_states, sampling_metadata)

    @classmethod
    def checkpoint_part(cls, name: str) -> tuple[str, str] | None:
        """(our submodule, the name its own load_weights expects) of checkpoint name `name`, by the longest prefix
        of `checkpoint_prefixes` it starts with; None when none does. LoRA maps adapter module names with it too."""
        match = max((p for p in cls.checkpoint_prefixes if name.startswith(p)), key=len, default=None)
        if match is None:
            return None
        part, inner = cls.checkpoint_prefixes[match]
        return part, inner + name[len(match):]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route each checkpoint tensor to its part (either layout); returns the loaded parameter names."""
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {name: [] for name, _ in self.checkpoint_prefixes.values()}
        unknown = []
        for name, tensor in weights:
            routed = self.checkpoint_part(name)
            if routed is None:
                unknown.append(name)
                continue
            part, inner = routed
            parts[part].append((inner, tensor))
        if unknown:
            raise ModelLoadError(f"{type(self).__name__} checkpoint tensors outside its language model, vision tower "
                                 f"and projector: {unknown[:8]}")
        loaded = set()
        for part, part_weights in parts.items():
            loaded |= {f"{part}.{name}" for name in getattr(self, part).load_weights(part_weights)}
        return loaded


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT: LLaVA 1.5's tower, projector and decoder over anyres tiles, packed with `image_newline` rows."""

    NEWLINE_NAMES = ("model.image_newline", "image_newline")  # the checkpoint layouts of transformers 5 and before

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        vision = config.vision_config
        if not self.drop_class_token and vit_config(vision).layout.class_token:
            raise ModelLoadError("vision_feature_select_strategy 'full' keeps the class token, which anyres tiles "
                                 "cannot be laid out with; LLaVA-NeXT checkpoints use 'default'")
        pinpoints = tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints)
        self.grid = AnyResGrid(pinpoints, vision.image_size, vision.image_size // vision.patch_size)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

    def embed_multimodal(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor,
                         **_: Any) -> list[torch.Tensor]:
        """pixel_values [1, tiles (+ batch padding), C, H, W], image_sizes [1, 2] (height, width) -> one
        [rows, hidden] tensor: the base tile's rows and the unpadded tile map's, a newline row after each row."""
        image_size = (int(image_sizes[0, 0]), int(image_sizes[0, 1]))
        tiles = pixel_values[0, : self.grid.num_tiles(image_size)]  # the processor pads to a prompt's most tiles
        features = self.encode_images(tiles)  # [1 + grid tiles, patches, hidden]
        return [self.grid.pack(features, image_size, self.image_newline)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """`image_newline` here, the rest routed as LLaVA 1.5's."""
        loaded: set[str] = set()

        def others() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in self.NEWLINE_NAMES:
                    self.image_newline.data.copy_(tensor)
                    loaded.add("image_newline")
                else:
                    yield name, tensor

        return super().load_weights(others()) | loaded


def maybe_prefix(prefix: str, name: str) -> str:
    """`prefix.name`, or `name` at the top (vLLM's helper of the same name)."""
    return f"{prefix}.{name}" if prefix else name
