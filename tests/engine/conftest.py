"""Fixtures shared by the engine tests: a tiny Llama over a real sentencepiece (Llama 2 style) tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny_models import save_tiny_llama, train_llama_tokenizer

EXTRA_TOKEN = "<extra>"  # added to the tokenizer after the model was built: its id is past the model's vocabulary


@pytest.fixture(scope="session")
def sentencepiece_llama(tmp_path_factory) -> Path:
    """A tiny random Llama whose tokenizer is a sentencepiece model trained by the test (vocabulary 420), plus
    one added token the model's 420 logits do not cover (as checkpoints with extra tokenizer entries have)."""
    path = tmp_path_factory.mktemp("sentencepiece_llama")
    tokenizer = train_llama_tokenizer(path / "tokenizer")
    save_tiny_llama(path, tokenizer, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    tokenizer.add_tokens([EXTRA_TOKEN])
    tokenizer.save_pretrained(path)
    return path
