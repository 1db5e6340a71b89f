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


SENTENCEPIECE_TEXT = """The quick brown fox jumps over the lazy dog. Hello world! Once upon a time there was a robot.
It said: "hello, how are you?" and the cat replied with a smile. Numbers like 12345 and 3.14 appear too.
Café, naïve, über and 世界 are rare here. The end of the story came when the sun set over the hills.
"""


def train_llama_tokenizer(path: Path, vocab_size: int = 420):
    """A Llama-2-style tokenizer trained here with sentencepiece (BPE, byte fallback, a dummy prefix space),
    saved in `path` as `tokenizer.model` and loaded by transformers' LlamaTokenizer."""
    import sentencepiece
    from transformers import LlamaTokenizer

    path.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCEPIECE_TEXT.splitlines() * 20), model_prefix=str(path / "sp"),
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1,
        eos_id=2, pad_id=-1, add_dummy_prefix=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", num_threads=1, minloglevel=2,
    )
    (path / "sp.model").rename(path / "tokenizer.model")
    (path / "sp.vocab").unlink()
    return LlamaTokenizer.from_pretrained(path)
