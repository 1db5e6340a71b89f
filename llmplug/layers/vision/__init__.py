"""Vision blocks for vision-language families: the encoder and the projectors into the language model.

Exports the ViT (`VisionTransformer`, built from a `ViTConfig` that `vit_config` reads from a CLIP or
SigLIP vision config; `ViTLayout` / `VIT_LAYOUTS` are the per-family flags) and the projectors
(`MLPProjector` for LLaVA, `PooledProjector` for Gemma 3, `LinearProjector` for PaliGemma, `PixelShuffleConnector`
for Idefics3 / SmolVLM, with `pixel_shuffle`; `ShuffledMLPProjector` for InternVL, Aya Vision and Llama 4's adapter;
`PatchMergerProjector` for Mistral 3), the Pixtral encoder (`PixtralVisionTransformer`, from a `PixtralViTConfig`
that `pixtral_vit_config` reads), and the any-resolution tiling of LLaVA-NeXT (`AnyResGrid`: tile counts and the
packing of the tiles' rows, with `select_best_resolution` and `unpad_features`); and the Qwen2-VL / Qwen2.5-VL
tower (`QwenVisionTransformer`, from a `QwenViTConfig` that `qwen_vit_config` reads) with its `PatchMerger`; the 2D
rotary of Pixtral's and Llama 4's towers (`axial_angles`, `interleaved_rotation`). Each
loads transformers' checkpoint names through its own `load_weights`.
"""

from llmplug.layers.vision.anyres import AnyResGrid, select_best_resolution, unpad_features
from llmplug.layers.vision.axial_rotary import axial_angles, interleaved_rotation
from llmplug.layers.vision.projectors import (
    LinearProjector,
    MLPProjector,
    PatchMergerProjector,
    PixelShuffleConnector,
    PooledProjector,
    ShuffledMLPProjector,
    pixel_shuffle,
)
from llmplug.layers.vision.pixtral_vit import PixtralViTConfig, PixtralVisionTransformer, pixtral_vit_config
from llmplug.layers.vision.qwen_vit import PatchMerger, QwenViTConfig, QwenVisionTransformer, qwen_vit_config
from llmplug.layers.vision.vit import VIT_LAYOUTS, ViTConfig, ViTLayout, VisionTransformer, vit_config

__all__ = [
    "AnyResGrid",
    "LinearProjector",
    "MLPProjector",
    "PatchMerger",
    "PatchMergerProjector",
    "PixelShuffleConnector",
    "PixtralViTConfig",
    "PixtralVisionTransformer",
    "PooledProjector",
    "QwenViTConfig",
    "QwenVisionTransformer",
    "ShuffledMLPProjector",
    "VIT_LAYOUTS",
    "ViTConfig",
    "ViTLayout",
    "VisionTransformer",
    "axial_angles",
    "interleaved_rotation",
    "pixel_shuffle",
    "pixtral_vit_config",
    "qwen_vit_config",
    "select_best_resolution",
    "unpad_features",
    "vit_config",
]
