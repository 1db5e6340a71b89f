"""Llama 4 with images against transformers on a tiny random checkpoint (its ViT with the 2D rotary, the
pixel-shuffle adapter, the linear projector; a 2-layer MoE Llama 4 decoder with chunked attention and a NoPE layer)
and drawn pictures of three layouts (2 x 2 tiles plus a global tile, 1 x 3 plus a global tile, one tile): greedy
tokens equal and log-probabilities within 1e-4 (float32), one and two images per prompt; chunks of 6 tokens (inside
images, between their tiles) with too few KV blocks (preempted, recomputed) in one engine; prefix caching by picture;
tensor parallelism (2 ranks); a real Llama 4 folder without torchvision refused with a clear ModelLoadError.

transformers' Llama 4 image processor is torchvision's only (its module imports torchvision, absent here), so the
test draws its own (PIL and numpy, under the same name); the prompt expansion is
transformers' `Llama4Processor`'s own, and llmplug and transformers get the same processor output."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from llmplug.core.errors import ModelLoadError
from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import gradient, shapes

TILE, PATCH = 32, 8
TOKENS_PER_TILE = 4  # (32 / 8) ** 2 patches, pixel-shuffled by 2
IMAGE_TOKENS = ["<|image_start|>", "<|image_end|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>",
                "<|image|>"]
ONE = "User: <|image|> What is in the picture?\nAssistant:"
TWO = "User: <|image|> and <|image|> Which one is brighter?\nAssistant:"


def supported_canvases(max_tiles: int, tile: int) -> np.ndarray:
    """[N, 2] (height, width) of every grid of at most `max_tiles` tiles, in transformers' order (most tiles first,
    each count's factor pairs grouped by aspect ratio)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return np.array([(r * tile, c * tile) for grids in by_ratio.values() for r, c in grids])


def best_canvas(height: int, width: int, canvases: np.ndarray, to_max: bool) -> tuple[int, int]:
    """transformers' `get_best_fit`: the smallest upscale without distortion (the largest with `to_max`), else the
    least downscale; the smallest area among equals."""
    scales = np.minimum(canvases[:, 0] / height, canvases[:, 1] / width).astype(np.float32)
    up = scales[scales >= 1]
    scale = (up.max() if to_max else up.min()) if len(up) else scales[scales < 1].max()
    chosen = canvases[scales == scale]
    h, w = chosen[np.argmin(chosen[:, 0] * chosen[:, 1])]
    return int(h), int(w)


def image_processor_class() -> type:
    """transformers' Llama4ImageProcessor in PIL and numpy: resize without distortion onto the best canvas of tiles
    (never upscaling past one tile), pad right and bottom, rescale and normalize, split into tiles row by row, and
    add the whole image resized to one tile when there are several; pixel_values [all tiles, C, H, W] and
    aspect_ratios [images, 2] (rows and columns of tiles). Float32 throughout (transformers' rounds through
    bfloat16)."""
    from transformers.image_processing_backends import PilBackend
    from transformers.image_processing_utils import BatchFeature
    from transformers.image_utils import PILImageResampling, SizeDict
    from transformers.processing_utils import ImagesKwargs

    class Llama4ImagesKwargs(ImagesKwargs, total=False):
        max_patches: int
        resize_to_max_canvas: bool

    class Llama4ImageProcessor(PilBackend):
        resample = PILImageResampling.BILINEAR
        image_mean = image_std = [0.5, 0.5, 0.5]
        size = {"height": 336, "width": 336}
        do_resize = do_rescale = do_normalize = do_convert_rgb = True
        max_patches = 16
        resize_to_max_canvas = False
        valid_kwargs = Llama4ImagesKwargs

        def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
            kwargs = self._merge_and_standardize_kwargs(**(images_kwargs or {}))
            size = kwargs["size"]
            canvases = supported_canvases(kwargs["max_patches"], size.height)
            h, w = best_canvas(height, width, canvases, kwargs["resize_to_max_canvas"])
            tiles = (h // size.height) * (w // size.width)
            return tiles + 1 if tiles > 1 else tiles

        def _preprocess(self, images, size, resample, rescale_factor, image_mean, image_std, max_patches,
                        resize_to_max_canvas, return_tensors, **_) -> BatchFeature:
            canvases = supported_canvases(max_patches, size.height)
            tiles, ratios = [], []
            for image in images:  # [C, H, W] uint8
                height, width = image.shape[-2:]
                canvas_h, canvas_w = best_canvas(height, width, canvases, resize_to_max_canvas)
                limit = (canvas_h, canvas_w) if resize_to_max_canvas else (
                    min(max(height, size.height), canvas_h), min(max(width, size.width), canvas_w))
                scale_h, scale_w = limit[0] / height, limit[1] / width
                new = (limit[0], min(math.floor(width * scale_h), limit[1])) if scale_h <= scale_w else (
                    min(math.floor(height * scale_w), limit[0]), limit[1])
                resized = self.resize(image, SizeDict(height=max(new[0], 1), width=max(new[1], 1)), resample)
                c, h, w = resized.shape
                canvas = np.zeros((c, canvas_h, canvas_w), dtype=np.float32)
                canvas[:, :h, :w] = resized
                rows, cols = canvas_h // size.height, canvas_w // size.width
                grid = self.normalize(self.rescale(canvas, rescale_factor), image_mean, image_std)
                grid = grid.reshape(c, rows, size.height, cols, size.width).transpose(1, 3, 0, 2, 4)
                tiles.append(grid.reshape(rows * cols, c, size.height, size.width))
                if rows * cols > 1:
                    whole = self.resize(image, size, resample).astype(np.float32)
                    tiles.append(self.normalize(self.rescale(whole, rescale_factor), image_mean, image_std)[None])
                ratios.append([rows, cols])
            data = {"pixel_values": np.concatenate(tiles).astype(np.float32), "aspect_ratios": np.array(ratios)}
            return BatchFeature(data=data, tensor_type=return_tensors)

    return Llama4ImageProcessor


@contextlib.contextmanager
def pil_processor_registered(image_processor: type) -> Iterator[None]:
    """The PIL image processor registered as Llama 4's PIL backend, found by its name (`Llama4ImageProcessor`, the
    type the folder's preprocessor config names), then the registration undone: transformers' own mapping names the
    torchvision class only. (`AutoImageProcessor.register` would first check that placeholder class, and refuse.)"""
    from transformers import Llama4Config
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING

    IMAGE_PROCESSOR_MAPPING.register(Llama4Config, {"pil": image_processor}, exist_ok=True)
    try:
        yield
    finally:
        IMAGE_PROCESSOR_MAPPING._extra_content.pop(Llama4Config, None)


@dataclass
class TinyLlama4:
    path: Path
    processor: object
    hf_model: torch.nn.Module


def _tokenizer(path: Path):
    tokenizer = train_llama_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    return tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Iterator[TinyLlama4]:
    """The ViT on 32 x 32 tiles (patch 8, 2 layers; its weights drawn larger than transformers' init, so the picture
    matters), a 2-layer Llama 4 decoder (layer 0: rotary, q/k norm, chunks of 8 tokens, dense MLP; layer 1: NoPE with
    temperature tuning, top-1 of 4 experts and a shared expert), and Llama4Processor over the PIL image processor
    (tiles of 32, at most 4 a picture)."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4Processor

    path = tmp_path_factory.mktemp("tiny_llama4")
    tokenizer = _tokenizer(path / "tokenizer")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in IMAGE_TOKENS}
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
                  patch_size=PATCH, pixel_shuffle_ratio=0.5, projector_input_dim=64, projector_output_dim=64,
                  vision_output_dim=64)
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=8,
                floor_scale=4, attn_scale=0.5, max_position_embeddings=512, bos_token_id=1, eos_token_id=None,
                pad_token_id=None, tie_word_embeddings=False)
    config = Llama4Config(vision_config=vision, text_config=text, image_token_index=ids["<|patch|>"],
                          boi_token_index=ids["<|image_start|>"], eoi_token_index=ids["<|image_end|>"],
                          tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for module in (model.vision_model, model.multi_modal_projector):
            for name, param in module.named_parameters():
                if "layernorm" not in name:
                    param.normal_(0, 0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    image_processor = image_processor_class()(size={"height": TILE, "width": TILE}, max_patches=4)
    processor = Llama4Processor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH)
    processor.save_pretrained(path)
    with pil_processor_registered(type(image_processor)):
        yield TinyLlama4(path, processor, model)


@pytest.fixture(scope="module")
def pictures() -> dict[str, object]:
    """2 x 2 tiles plus a global one (60 x 40), 1 x 3 plus a global one (96 x 30), one tile (24 x 24)."""
    return {"grid": gradient(60, 40), "wide": shapes(96, 30), "small": shapes(24, 24)}


@pytest.fixture(scope="module")
def case(tiny, pictures) -> MultimodalParityCase:
    g, w, s = pictures["grid"], pictures["wide"], pictures["small"]
    prompts = tuple(MultimodalPrompt(text, imgs) for text, imgs in [(ONE, (g,)), (ONE, (w,)), (TWO, (s, g))])
    return MultimodalParityCase("Llama4ForConditionalGeneration", tiny.path, tiny.processor, tiny.hf_model, prompts,
                                chunk_budget=6, preemption_blocks=20, max_tokens=6)


def test_plain_matches_transformers_with_each_tile_layout_and_the_prefix_cache_follows_the_picture(mm_parity, case):
    """Each picture one item over its tiles' runs (the single tile's run alone), then the prefix cache by picture."""
    with mm_parity.engine(case) as llm:
        model = llm.llm_engine.engine_core.executor.worker.model_runner.model
        assert type(model).__name__ == case.name  # ours, not the transformers backend
        mm_parity.check(case, "plain", llm)
        _, features = llm.llm_engine.processor.mm_processor.process(TWO, None, list(case.prompts[2].images))
        mm_parity.check_prefix_cache(case, llm)
    tiles = [f.data["pixel_values"].shape[0] for f in features]
    assert tiles == [1, 5] and [f.num_embeds for f in features] == [n * TOKENS_PER_TILE for n in tiles]
    assert features[0].is_embed is None and features[1].length == 25  # 4 tiles, 4 separators, <|image|>, the global


@pytest.mark.parametrize("variant", ["preemption", "tp2"])
def test_chunked_inside_images_preempted_and_tensor_parallel_match_transformers(mm_parity, case, variant):
    """preemption: steps of 6 tokens (an image's span is 4 to 25) and 20 KV blocks of 4 for three prompts of 59 to 72
    tokens; tp2: each rank runs half the vision heads and MLP, half the decoder's, on the same pictures."""
    mm_parity.check(case, variant)


def test_a_llama4_folder_without_torchvision_is_a_clear_load_error(tiny, tmp_path):
    """transformers' Llama 4 image processor exists only for torchvision: without our PIL one registered, the folder's
    processor cannot be built, and the engine says why and what fixes it."""
    import importlib.util

    from transformers import Llama4Config
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING

    from llmplug.engine.multimodal import MultiModalProcessor

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the processor loads")
    folder = shutil.copytree(tiny.path, tmp_path / "llama4")
    saved = json.loads((folder / "processor_config.json").read_text())  # what a real Llama 4 folder names
    assert (saved["processor_class"], saved["image_processor"]["image_processor_type"]) == \
        ("Llama4Processor", "Llama4ImageProcessor")
    registered = IMAGE_PROCESSOR_MAPPING._extra_content.pop(Llama4Config)
    try:
        with pytest.raises(ModelLoadError, match="processor cannot be loaded here.*torchvision"):
            MultiModalProcessor(str(folder), tiny.hf_model.config.image_token_id, {"image": 1})
    finally:
        IMAGE_PROCESSOR_MAPPING._extra_content[Llama4Config] = registered
