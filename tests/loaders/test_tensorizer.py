"""`llmplug tensorize` and the tensorizer loader: a tiny Llama serialized with tensorizer loads back to
transformers' logits and greedy tokens; damaged files and unreachable URIs are errors that name them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from llmplug.core.errors import ModelLoadError
from llmplug.entrypoints.cli import main
from llmplug.loaders.tensorizer import TENSORS_FILE
from tests.loaders.gguf_writer_utils import make_tiny_model, write_model_gguf
from tests.loaders.parity import corrupt, hf_greedy, hf_logits, load_model, our_greedy, our_logits, truncate
from tests.models.tiny_models import TinyModel, make_tiny

pytest.importorskip("tensorizer")

ATOL = 1e-4  # fp32, as in tests/models/test_llama_parity.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def tensorized(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tensorized")
    assert main(["tensorize", str(tiny.path), str(out)]) == 0
    return out


def test_tensorize_writes_config_and_tensors_only(tensorized: Path) -> None:
    assert (tensorized / "config.json").is_file() and (tensorized / TENSORS_FILE).is_file()
    assert not list(tensorized.glob("*.safetensors"))  # the loader cannot be reading anything else


def test_tensorized_model_matches_transformers_and_the_default_loader(tiny: TinyModel, tensorized: Path) -> None:
    model = load_model(tensorized, "tensorizer")
    default = load_model(tiny.path, "default")
    for (name, ours), theirs in zip(model.state_dict().items(), default.state_dict().values()):
        assert torch.equal(ours, theirs), name
    assert (our_logits(model) - hf_logits(tiny.hf_model)).abs().max().item() < ATOL


def test_tensorizer_uri_points_at_tensors_elsewhere(tiny: TinyModel, tensorized: Path, tmp_path: Path) -> None:
    moved = shutil.copy(tensorized / TENSORS_FILE, tmp_path / "elsewhere.tensors")
    model = load_model(tiny.path, "tensorizer", tensorizer_uri=str(moved))  # config from the HF directory
    assert (our_logits(model) - hf_logits(tiny.hf_model)).abs().max().item() < ATOL


def test_remote_uri_is_passed_to_tensorizer(tiny: TinyModel) -> None:
    uri = "http://127.0.0.1:9/model.tensors"  # tensorizer itself tries (and fails) to open it
    with pytest.raises(ModelLoadError, match=f"tensorizer file {uri}"):
        load_model(tiny.path, "tensorizer", tensorizer_uri=uri)


def test_greedy_generation_end_to_end_matches_transformers(tiny: TinyModel, tensorized: Path) -> None:
    assert our_greedy(tensorized, "tensorizer") == hf_greedy(tiny.hf_model)


def test_tensorize_takes_any_format_llmplug_loads(tmp_path: Path) -> None:
    hf = make_tiny_model()
    gguf_file = write_model_gguf(tmp_path / "tiny.gguf", hf)  # config, tokenizer and weights in one file
    out = tmp_path / "out"
    assert main(["tensorize", str(gguf_file), str(out)]) == 0
    assert (out / "tokenizer.json").is_file()  # the GGUF's tokenizer, saved by transformers
    prompt = [1, 20, 7, 130, 99]
    ours = our_logits(load_model(out, "tensorizer"), prompt)
    assert (ours - hf_logits(hf, prompt)).abs().max().item() < ATOL


@pytest.mark.parametrize("damage", ["truncate", "truncate_in_header", "corrupt_data", "missing"])
def test_damaged_file_names_it(tensorized: Path, tmp_path: Path, damage: str) -> None:
    broken = Path(shutil.copytree(tensorized, tmp_path / "broken"))
    file = broken / TENSORS_FILE
    if damage == "truncate":
        truncate(file)
    elif damage == "truncate_in_header":  # a cut inside a tensor's header fails in tensorizer's struct unpacking
        data = file.read_bytes()
        file.write_bytes(data[: data.rindex(b"model.layers.") + 4])
    elif damage == "corrupt_data":
        corrupt(file, offset=file.stat().st_size - 200, length=16)  # inside the last tensor's data
    else:
        file.unlink()
    with pytest.raises(ModelLoadError, match=str(file)):
        load_model(broken, "tensorizer")
