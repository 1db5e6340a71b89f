"""The vision blocks equal transformers' own modules on the same weights and pixels (float32): the ViT as
CLIPVisionModel and SiglipVisionModel at any feature layer, and the LLaVA, Gemma 3 and Idefics3 projectors.
Weights go through each block's `load_weights` under their checkpoint names, so the name maps are tested too."""

from __future__ import annotations

from typing import Iterable

import pytest
import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel

from llmplug.communicators.parallel_state import (
    DistributedEnv,
    destroy_distributed_environment,
    init_distributed_environment,
    initialize_model_parallel,
)
from llmplug.core.errors import ModelLoadError
from llmplug.layers.vision import (
    MLPProjector,
    PixelShuffleConnector,
    PooledProjector,
    VisionTransformer,
    pixel_shuffle,
    vit_config,
)
from llmplug.layers.weight_utils import missing_parameters
from tests.communicators.ranks import run_ranks

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32)


def _clip() -> CLIPVisionModel:
    torch.manual_seed(0)
    return CLIPVisionModel(CLIPVisionConfig(**SHAPE, patch_size=8)).eval()


def _siglip() -> SiglipVisionModel:
    torch.manual_seed(0)
    return SiglipVisionModel(SiglipVisionConfig(**SHAPE, patch_size=8, vision_use_head=True)).eval()


def _checkpoint(module: nn.Module, prefix: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    """The module's tensors as a checkpoint names them (`prefix` + transformers' names, buffers left out)."""
    return ((prefix + name, tensor) for name, tensor in module.state_dict().items() if "position_ids" not in name)


def _load(ours: nn.Module, hf: nn.Module, prefix: str = "") -> nn.Module:
    """`ours` with `hf`'s weights loaded through its load_weights; every parameter must have been loaded."""
    loaded = ours.load_weights(_checkpoint(hf, prefix))
    assert missing_parameters(ours, loaded) == []
    return ours.eval()


def _pixels(size: int = 32, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("make_hf", [_clip, _siglip], ids=["clip", "siglip"])
@pytest.mark.parametrize("feature_layer", [-2, -1, 0, 1])
def test_feature_layer_is_transformers_hidden_state(make_hf, feature_layer: int) -> None:
    hf = make_hf()
    ours = _load(VisionTransformer(vit_config(hf.config), feature_layer), hf, "vision_model.")
    pixels = _pixels()
    with torch.no_grad():
        expected = hf(pixels, output_hidden_states=True).hidden_states[feature_layer]
        torch.testing.assert_close(ours(pixels), expected, atol=1e-5, rtol=1e-5)


def test_only_the_layers_up_to_the_feature_layer_are_built() -> None:
    hf = _clip()  # 3 layers: hidden_states[-2] is the second's output
    ours = _load(VisionTransformer(vit_config(hf.config), -2), hf, "vision_model.")
    assert len(ours.encoder.layers) == 2 and not hasattr(ours, "post_layernorm")


def test_clip_without_class_token_is_llava_default_selection() -> None:
    hf = _clip()  # LLaVA's "default" strategy drops the class token from hidden_states[-2]
    ours = _load(VisionTransformer(vit_config(hf.config), -2), hf)
    pixels = _pixels()
    with torch.no_grad():
        expected = hf(pixels, output_hidden_states=True).hidden_states[-2][:, 1:]
        torch.testing.assert_close(ours(pixels)[:, 1:], expected, atol=1e-5, rtol=1e-5)
    assert ours(pixels).shape == (2, 17, 32)  # 16 patches and the class token


def test_clip_last_hidden_state_and_pooled_class_token() -> None:
    hf = _clip()
    ours = _load(VisionTransformer(vit_config(hf.config)), hf, "vision_model.")
    pixels = _pixels()
    with torch.no_grad():
        out, last = hf(pixels), ours(pixels)
        torch.testing.assert_close(last, out.last_hidden_state, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.pool(last), out.pooler_output, atol=1e-5, rtol=1e-5)


def test_siglip_last_hidden_state_is_post_normed_and_head_is_skipped() -> None:
    hf = _siglip()  # its attention-pooling head is in the checkpoint; no VLM uses it
    ours = _load(VisionTransformer(vit_config(hf.config)), hf, "vision_model.")
    pixels = _pixels()
    with torch.no_grad():
        torch.testing.assert_close(ours(pixels), hf(pixels).last_hidden_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make_hf", [_clip, _siglip], ids=["clip", "siglip"])
def test_other_image_sizes_interpolate_position_embeddings(make_hf) -> None:
    hf = make_hf()
    ours = _load(VisionTransformer(vit_config(hf.config), -1), hf)
    pixels = _pixels(size=48)  # a 6 x 6 grid from the trained 4 x 4
    with torch.no_grad():
        expected = hf(pixels, output_hidden_states=True, interpolate_pos_encoding=True).hidden_states[-1]
        torch.testing.assert_close(ours(pixels), expected, atol=1e-5, rtol=1e-5)


def test_several_feature_layers_are_concatenated() -> None:
    hf = _siglip()
    ours = _load(VisionTransformer(vit_config(hf.config), (-3, -1)), hf)
    pixels = _pixels()
    with torch.no_grad():
        states = hf(pixels, output_hidden_states=True).hidden_states
        torch.testing.assert_close(ours(pixels), torch.cat([states[-3], states[-1]], -1), atol=1e-5, rtol=1e-5)


def test_out_of_range_feature_layer_and_unknown_tensors_are_errors() -> None:
    config = vit_config(_clip().config)
    with pytest.raises(ValueError, match="outside the 4 hidden states"):
        VisionTransformer(config, -5)
    with pytest.raises(ModelLoadError, match=r"encoder\.layers\.0\.self_attn\.z_proj\.weight"):
        unknown = "vision_model.encoder.layers.0.self_attn.z_proj.weight"
        VisionTransformer(config).load_weights([(unknown, torch.zeros(1))])
    with pytest.raises(ValueError, match="'bert' is not a ViT"):
        vit_config(type("Config", (), {"model_type": "bert"})())


def test_llava_projector_equals_transformers() -> None:
    from transformers import LlamaConfig, LlavaConfig
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, num_attention_heads=4),
        text_config=LlamaConfig(hidden_size=48, num_attention_heads=4),
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
    )
    hf = LlavaMultiModalProjector(config).eval()
    ours = _load(MLPProjector(32, 48, config.projector_hidden_act, config.multimodal_projector_bias), hf)
    features = torch.randn(2, 17, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(features), hf(features), atol=1e-5, rtol=1e-5)


def test_gemma3_projector_equals_transformers() -> None:
    from transformers import Gemma3Config, Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=32, image_size=64, patch_size=8)  # an 8 x 8 grid pooled to 2 x 2
    config = Gemma3Config(text_config=Gemma3TextConfig(hidden_size=48), vision_config=vision, mm_tokens_per_image=4)
    hf = Gemma3MultiModalProjector(config).eval()
    with torch.no_grad():  # transformers initializes both to zeros: random weights make the test mean something
        hf.mm_input_projection_weight.normal_()
        hf.mm_soft_emb_norm.weight.normal_()
    ours = _load(PooledProjector(32, 48, 8, config.mm_tokens_per_image, vision.layer_norm_eps), hf)
    features = torch.randn(2, 64, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(features), hf(features), atol=1e-5, rtol=1e-5)
    assert ours(features).shape == (2, 4, 48)


def test_idefics3_connector_equals_transformers() -> None:
    from transformers import Idefics3Config
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    torch.manual_seed(0)
    config = Idefics3Config(
        vision_config={"hidden_size": 32, "num_attention_heads": 4},
        text_config={"hidden_size": 48, "num_attention_heads": 4},
        scale_factor=2,
    )
    hf = Idefics3Connector(config).eval()
    ours = _load(PixelShuffleConnector(32, 48, config.scale_factor), hf)
    features = torch.randn(2, 16, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(features), hf(features), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pixel_shuffle(features, 2), hf.pixel_shuffle(features, 2))


def _vit_and_projector_on_this_rank() -> torch.Tensor:
    """In each of 2 tensor-parallel ranks: the CLIP ViT (half the heads and MLP features) and the LLaVA projector,
    loaded from the whole checkpoint; their output (whole on every rank after the all-reduces)."""
    init_distributed_environment(DistributedEnv.from_environ())
    initialize_model_parallel(tp=2, pp=1, dp=1)
    hf = _clip()
    vit = _load(VisionTransformer(vit_config(hf.config), -2), hf, "vision_model.")
    assert vit.encoder.layers[0].self_attn.num_heads == 2
    projector = MLPProjector(32, 48)
    projector.load_weights(_projector_weights().items())
    with torch.no_grad():
        out = projector(vit(_pixels()))
    destroy_distributed_environment()
    return out


def _projector_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    shapes = {"linear_1.weight": (48, 32), "linear_1.bias": (48,), "linear_2.weight": (48, 48), "linear_2.bias": (48,)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def test_tensor_parallel_ranks_each_compute_the_whole_output() -> None:
    hf = _clip()
    w = _projector_weights()
    with torch.no_grad():
        features = hf(_pixels(), output_hidden_states=True).hidden_states[-2]
        hidden = torch.nn.functional.gelu(features @ w["linear_1.weight"].T + w["linear_1.bias"])
        expected = hidden @ w["linear_2.weight"].T + w["linear_2.bias"]
    for out in run_ranks(_vit_and_projector_on_this_rank, world_size=2):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [(38, 38), (24, 40)], ids=["trained_grid", "other_grid"])
def test_idefics3_bucketed_positions_equal_transformers(size: tuple[int, int]) -> None:
    """Idefics3 / SmolVLM's ViT: position ids bucketed from fractional coordinates, which on a 19 x 19 trained grid
    map some patches to a neighbour's id (float32), and on another full grid stretch it over the trained table."""
    from transformers import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    torch.manual_seed(0)
    hf = Idefics3VisionTransformer(Idefics3VisionConfig(**{**SHAPE, "image_size": 38}, patch_size=2)).eval()
    ours = _load(VisionTransformer(vit_config(hf.config)), hf)
    pixels = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(pixels), hf(pixels).last_hidden_state, atol=1e-5, rtol=1e-5)
