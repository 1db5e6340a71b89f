"""The runai_streamer loader streams safetensors (single and sharded) to transformers' logits and greedy
tokens; its concurrency and memory limit come from LoadConfig; a damaged file is an error naming it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from llmplug.core.errors import ModelLoadError
from llmplug.loaders import runai_streamer
from tests.loaders.parity import hf_greedy, hf_logits, load_model, our_greedy, our_logits, truncate
from tests.models.tiny_models import TinyModel, make_tiny

pytest.importorskip("runai_model_streamer")

ATOL = 1e-4  # fp32, as in tests/models/test_llama_parity.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


def test_streamed_model_matches_transformers(tiny: TinyModel) -> None:
    model = load_model(tiny.path, "runai_streamer")
    assert (our_logits(model) - hf_logits(tiny.hf_model)).abs().max().item() < ATOL


def test_sharded_checkpoint_streams_every_shard(tiny: TinyModel, tmp_path: Path) -> None:
    tiny.hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_model(tmp_path, "runai_streamer")
    assert (our_logits(model) - hf_logits(tiny.hf_model)).abs().max().item() < ATOL


def test_concurrency_and_memory_limit_reach_the_streamer_while_it_streams(
    tiny: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    stream = runai_streamer._stream

    def spy(*args):
        for item in stream(*args):
            seen.append((os.environ.get(runai_streamer.CONCURRENCY_ENV), os.environ.get(runai_streamer.MEMORY_LIMIT_ENV)))
            yield item

    monkeypatch.delenv(runai_streamer.CONCURRENCY_ENV, raising=False)
    monkeypatch.setenv(runai_streamer.MEMORY_LIMIT_ENV, "123456789")
    monkeypatch.setattr(runai_streamer, "_stream", spy)
    load_model(tiny.path, "runai_streamer", runai_concurrency=3, runai_memory_limit=2**20)
    assert set(seen) == {("3", str(2**20))}
    assert runai_streamer.CONCURRENCY_ENV not in os.environ  # restored after streaming
    assert os.environ[runai_streamer.MEMORY_LIMIT_ENV] == "123456789"


def test_memory_limit_below_the_largest_tensor_is_refused(tiny: TinyModel) -> None:
    with pytest.raises(ModelLoadError, match="Memory limit supplied: 1024"):
        load_model(tiny.path, "runai_streamer", runai_memory_limit=1024)


def test_greedy_generation_end_to_end_matches_transformers(tiny: TinyModel) -> None:
    assert our_greedy(tiny.path, "runai_streamer", runai_concurrency=2) == hf_greedy(tiny.hf_model)


def test_truncated_file_names_it(tiny: TinyModel, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(tiny.path, tmp_path / "broken"))
    truncate(broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=str(broken / "model.safetensors")):
        load_model(broken, "runai_streamer")
