"""Fixtures of the LoRA tests: tiny Llama and Qwen3 checkpoints and their random PEFT adapters, once per session."""

from __future__ import annotations

import pytest

from tests.models.tiny_models import TinyModel, make_tiny

from .adapters import SPECS, VOCAB_SPECS, Adapter, save_adapter


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A tiny random checkpoint."""
    return make_tiny(request.param, tmp_path_factory.mktemp(f"lora-{request.param}"))


@pytest.fixture(scope="session")
def adapters(base: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Adapter]:
    """Every adapter of SPECS and VOCAB_SPECS over `base`, each from its own seed."""
    root = tmp_path_factory.mktemp(f"adapters-{base.name}")
    names = [*SPECS, *VOCAB_SPECS]
    return {name: save_adapter(base.path, name, root / name, seed=i + 1) for i, name in enumerate(names)}
