"""Vision blocks for vision-language families: the encoder and the projectors into the language model.

Exports the ViT (`VisionTransformer`, built from a `ViTConfig` that `vit_config` reads from a CLIP or
SigLIP vision config; `ViTLayout` / `VIT_LAYOUTS` are the per-family flags) and the projectors
(`MLPProjector` for LLaVA, `PooledProjector` for Gemma 3, `PixelShuffleConnector` for Idefics3 / SmolVLM,
with `pixel_shuffle`). Each loads transformers' checkpoint names through its own `load_weights`.
"""

from llmplug.layers.vision.projectors import MLPProjector, PixelShuffleConnector, PooledProjector, pixel_shuffle
from llmplug.layers.vision.vit import VIT_LAYOUTS, ViTConfig, ViTLayout, VisionTransformer, vit_config

__all__ = [
    "MLPProjector",
    "PixelShuffleConnector",
    "PooledProjector",
    "VIT_LAYOUTS",
    "ViTConfig",
    "ViTLayout",
    "VisionTransformer",
    "pixel_shuffle",
    "vit_config",
]
