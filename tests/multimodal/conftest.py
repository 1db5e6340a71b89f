"""A tiny random LLaVA 1.5 (CLIP ViT 32x32, patch 8: 16 image tokens; a 2-layer Llama) saved with its LlavaProcessor,
and pictures drawn here (two sizes, two aspect ratios)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from llmplug.testing import MultimodalParityRunner
from tests.models.tiny_models import save_tiny_llama, train_llama_tokenizer

IMAGE_TOKEN = "<image>"
NUM_IMAGE_TOKENS = 16  # (32 / 8) ** 2 patches, the class token dropped
# a chat template of the processor's kind: content parts, images as the placeholder
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass
class TinyVLM:
    """A tiny vision-language checkpoint: its folder, transformers' processor and model saved there."""

    path: Path
    processor: object
    hf_model: torch.nn.Module


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> TinyVLM:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    path = tmp_path_factory.mktemp("tiny_llava")
    tokenizer = train_llama_tokenizer(path / "tokenizer")
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                       eos_token_id=None)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()  # transformers' init: its greedy tokens follow the image
    model.save_pretrained(path)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return TinyVLM(path, processor, model)


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory) -> Path:
    """A text-only tiny Llama, to be sent images."""
    path = tmp_path_factory.mktemp("tiny_text")
    tokenizer = train_llama_tokenizer(path / "tokenizer")
    save_tiny_llama(path, tokenizer, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    return path


def copy_with_renamed_weights(source: Path, target: Path, renames: dict[str, str]) -> dict[str, torch.Tensor]:
    """Copy a checkpoint folder, each tensor name's prefix in `renames` replaced (another layout of the same
    weights); returns the renamed tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    renamed = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        old = next(p for p in renames if name.startswith(p))
        renamed[renames[old] + name[len(old):]] = tensor
    for item in source.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy(item, target / item.name)
    save_file(renamed, target / "model.safetensors", metadata={"format": "pt"})
    return renamed


def gradient(width: int, height: int) -> Image.Image:
    """A red-to-blue horizontal gradient over a green vertical one."""
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    return Image.fromarray(np.stack([x, y, 255 - x], -1).astype(np.uint8))


def shapes(width: int, height: int) -> Image.Image:
    """A yellow disc and a dark square on white."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.ellipse((2, 2, width // 2, height // 2), fill="yellow", outline="black")
    draw.rectangle((width // 2, height // 2, width - 3, height - 3), fill=(30, 30, 90))
    return image


@pytest.fixture(scope="session")
def images() -> dict[str, Image.Image]:
    """Two sizes and aspect ratios (landscape 60x40, portrait 48x64)."""
    return {"gradient": gradient(60, 40), "shapes": shapes(48, 64)}


@pytest.fixture(scope="session")
def mm_parity() -> MultimodalParityRunner:
    """The multimodal parity kit; transformers' answer to each case's prompt is computed once a session."""
    return MultimodalParityRunner()


@pytest.fixture(scope="module")
def llm(mm_parity, case):
    """An engine of the plain variant on the module's `case`, shared by the checks that need no other settings."""
    with mm_parity.engine(case) as engine:
        yield engine


def model_runner(llm):
    """The model runner of an in-process engine (its model, encoder cache)."""
    return llm.llm_engine.engine_core.executor.worker.model_runner
