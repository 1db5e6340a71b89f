"""The worker reads a model's context length from whichever key its config uses, as vLLM does."""

from __future__ import annotations

import logging

import pytest
from transformers import BloomConfig, GPT2Config, LlamaConfig, MptConfig

from llmplug.engine.worker import DEFAULT_CONTEXT_LENGTH, context_length_of


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (LlamaConfig(max_position_embeddings=300), 300),
        (GPT2Config(n_positions=77), 77),  # attribute_map: max_position_embeddings -> n_positions
        (MptConfig(max_seq_len=123), 123),
    ],
    ids=["max_position_embeddings", "n_positions", "max_seq_len"],
)
def test_context_length_comes_from_the_key_the_config_has(config: object, expected: int) -> None:
    assert context_length_of(config) == expected


def test_the_smallest_of_several_context_keys_wins() -> None:
    config = LlamaConfig(max_position_embeddings=4096)
    config.seq_length = 1024
    assert context_length_of(config) == 1024


def test_a_config_without_a_context_key_gets_2048_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="llmplug.engine.worker"):
        assert context_length_of(BloomConfig()) == DEFAULT_CONTEXT_LENGTH == 2048
    assert "max_position_embeddings" in caplog.text and "max_model_len" in caplog.text
