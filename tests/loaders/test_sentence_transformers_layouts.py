"""A sentence-transformers folder saved by the installed sentence-transformers (6's module paths and named pooling
modes) embeds as that library does, like one in the hub's classic layout; an unsupported mode is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from llmplug import LLM
from llmplug.core.errors import ModelLoadError
from llmplug.loaders.default_model import resolve_model_path
from llmplug.loaders.sentence_transformers import read_sentence_transformers

SENTENCES = ["The cat sat on the mat.", "Embeddings map text to vectors.", "It's 25°C outside."]


@pytest.fixture(scope="module")
def resaved(tmp_path_factory) -> tuple[str, SentenceTransformer]:
    """all-MiniLM-L6-v2 (classic layout) loaded and saved again by the installed sentence-transformers."""
    model = SentenceTransformer(resolve_model_path("all-MiniLM-L6-v2"), device="cpu")
    path = tmp_path_factory.mktemp("st6") / "minilm"
    model.save(str(path))
    return str(path), model


def test_a_folder_saved_by_sentence_transformers_6_embeds_as_sentence_transformers(resaved) -> None:
    path, model = resaved
    modules = json.loads((Path(path) / "modules.json").read_text())
    assert any(not m["type"].startswith("sentence_transformers.models.") for m in modules)  # the new layout
    settings = read_sentence_transformers(path)
    assert (settings.pooling_type, settings.normalize) == ("MEAN", True)
    expected = model.encode(SENTENCES, convert_to_numpy=True)
    llm = LLM(path, dtype="float32", device={"num_threads": 1})
    try:
        got = np.array([out.outputs.embedding for out in llm.embed(SENTENCES, use_tqdm=False)])
    finally:
        llm.shutdown()
    np.testing.assert_allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("mode,expected", [("cls", "CLS"), ("lasttoken", "LAST"), (["mean"], "MEAN")])
def test_named_pooling_modes_map_to_the_engines(resaved, tmp_path, mode, expected) -> None:
    path = _with_pooling(resaved[0], tmp_path, {"pooling_mode": mode})
    assert read_sentence_transformers(path).pooling_type == expected


@pytest.mark.parametrize("mode", ["max", ["mean", "max"], "weightedmean"])
def test_a_pooling_mode_the_engine_lacks_is_refused_by_name(resaved, tmp_path, mode) -> None:
    path = _with_pooling(resaved[0], tmp_path, {"pooling_mode": mode})
    with pytest.raises(ModelLoadError, match=r"pooling \[.*'max'|pooling \['weightedmean'\]"):
        read_sentence_transformers(path)


def _with_pooling(source: str, tmp_path, config: dict) -> str:
    """A copy of the folder with another pooling config."""
    folder = tmp_path / "folder"
    shutil.copytree(source, folder)
    pooling = next(m for m in json.loads((folder / "modules.json").read_text()) if m["type"].endswith(".Pooling"))
    (folder / pooling["path"] / "config.json").write_text(json.dumps({"embedding_dimension": 384, **config}))
    return str(folder)
