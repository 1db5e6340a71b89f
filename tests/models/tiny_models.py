"""Tiny random Llama-family checkpoints written by transformers, one per architecture flag set."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from llmplug.core.config import EngineConfig, LoadConfig, ModelConfig
from llmplug.loaders.default import DefaultLoader
from llmplug.plugins.models import llama
from llmplug.testing import TINY_SIZES, randomize_
from llmplug.testing.tiny import NO_SPECIAL_TOKENS

SIZES = {**TINY_SIZES, **NO_SPECIAL_TOKENS, "rms_norm_eps": 1e-5}

# name -> (HF config, our class): together they cover q/k/v/o and MLP biases, tied embeddings,
# q/k norm, an explicit head_dim different from hidden / heads, and a scaled rope.
ARCHS = {
    "llama": (
        lambda **o: LlamaConfig(
            **{**SIZES, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False, **o}
        ),
        llama.LlamaForCausalLM,
    ),
    "mistral": (
        lambda **o: MistralConfig(**{**SIZES, "head_dim": 16, "sliding_window": None, **o}), llama.MistralForCausalLM
    ),
    "qwen2": (lambda **o: Qwen2Config(**{**SIZES, "tie_word_embeddings": True, **o}), llama.Qwen2ForCausalLM),
    "qwen3": (
        lambda **o: Qwen3Config(
            **{
                **SIZES,
                "head_dim": 32,
                "tie_word_embeddings": False,
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                **o,
            }
        ),
        llama.Qwen3ForCausalLM,
    ),
}


@dataclass
class TinyModel:
    """A saved tiny checkpoint, the transformers model that wrote it, and our class for it."""

    name: str
    path: Path
    hf_model: torch.nn.Module
    model_class: type

    def load(self, dtype: str = "float32") -> torch.nn.Module:
        """Our model, built by DefaultLoader from the saved checkpoint."""
        config = EngineConfig(model=ModelConfig(model=str(self.path), dtype=dtype))
        return DefaultLoader(LoadConfig()).load_model(config, model_class=self.model_class)


def save_tiny_llama(path: Path, tokenizer, **config) -> None:
    """A tiny random Llama (hidden 64, 2 layers) over `tokenizer`'s vocabulary, saved with the tokenizer."""
    hf_config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    randomize_(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def make_tiny(name: str, path: Path, seed: int = 0, overrides: dict | None = None, **save_kwargs) -> TinyModel:
    """Build, randomize (from `seed`) and save the tiny `name` model (its config fields changed by `overrides`)
    into `path`."""
    config_fn, cls = ARCHS[name]
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config_fn(**(overrides or {})), dtype=torch.float32).eval()
    randomize_(hf_model, seed)
    hf_model.save_pretrained(path, **save_kwargs)
    return TinyModel(name, path, hf_model, cls)
