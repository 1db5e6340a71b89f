"""Fixtures of the model tests: each tiny architecture saved once per session."""

from __future__ import annotations

import pytest

from .tiny_models import ARCHS, TinyModel, make_tiny


@pytest.fixture(scope="session", params=sorted(ARCHS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """Each tiny architecture, saved as safetensors."""
    return make_tiny(request.param, tmp_path_factory.mktemp(request.param))
