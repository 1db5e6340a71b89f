"""Tiny random checkpoints written by transformers itself, for parity tests.

`tiny_config(GemmaConfig, ...)` shrinks any transformers config to a few hundred thousand parameters
(hidden 64, 2 layers, vocabulary 256) and clears its special tokens, so greedy generation never
stops or masks early. `save_tiny_checkpoint` builds the transformers model from it, gives every
parameter a random value large enough for distinct logits, and saves it as safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import json

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

__all__ = ["TINY_SIZES", "TinyCheckpoint", "randomize_", "save_tiny_checkpoint", "tiny_config"]

# transformers' standard names; configs with their own names (GPT-2's n_embd, ...) map them
TINY_SIZES: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _known_fields(config_class: type[PretrainedConfig]) -> set[str]:
    """Field names a config class takes, its own or through its attribute_map."""
    own = getattr(config_class, "__dataclass_fields__", None)  # transformers 5 configs are dataclasses
    names = set(own) if own else set(config_class().to_dict())
    return names | set(getattr(config_class, "attribute_map", {}))


def tiny_config(config_class: type[PretrainedConfig], **fields: Any) -> PretrainedConfig:
    """`config_class` with the TINY_SIZES it has, no special tokens, then `fields` on top."""
    known = _known_fields(config_class)
    base = {k: v for k, v in {**TINY_SIZES, **NO_SPECIAL_TOKENS}.items() if k in known}
    config = config_class(**{**base, **fields})
    if "eos_token_id" not in fields:  # some configs fill a default eos in when given None (GLM)
        config.eos_token_id = None
    return config


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter random with std 0.1: norm scales around 1, everything else around 0."""
    generator = torch.Generator().manual_seed(seed)
    scales = {id(m.weight) for m in model.modules() if "Norm" in type(m).__name__ and hasattr(m, "weight")}
    with torch.no_grad():
        for param in model.parameters():
            mean = 1.0 if id(param) in scales else 0.0
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + mean)


@dataclass
class TinyCheckpoint:
    """A saved tiny checkpoint and the transformers model that wrote it (the reference)."""

    path: Path
    hf_model: torch.nn.Module

    @property
    def architecture(self) -> str:
        return self.hf_model.config.architectures[0]


def save_tiny_checkpoint(
    config: PretrainedConfig,
    path: Path,
    seed: int = 0,
    attn_implementation: str = "eager",
    architecture: str | None = None,
) -> TinyCheckpoint:
    """Build `config`'s causal LM in float32 (eager attention unless told), randomize it from `seed`, save it;
    `architecture` replaces the class name transformers writes into config.json's `architectures`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    model.eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    if architecture is not None:
        config_file = Path(path) / "config.json"
        saved = json.loads(config_file.read_text())
        config_file.write_text(json.dumps(saved | {"architectures": [architecture]}, indent=2))
    return TinyCheckpoint(Path(path), model)
