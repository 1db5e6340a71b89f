"""A third-party loader (tests/plugins/toy_loader, `load.format: npz`), pip-installed, runs the engine end to end;
the engine calls its `download_model` first, which finds models locally or in the HF cache (offline) only."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ModelLoadError
from tests.engine.test_llm import generate_ids, hf_greedy
from tests.models.tiny_models import make_tiny
from tests.plugin_examples import example_site_fixtures, run_python, save_as_npz

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 9], [200, 3, 3, 3, 41, 8, 8, 1, 90]]
ENGINE = {"load_format": "npz", "dtype": "float32", "skip_tokenizer_init": True, "block_size": 4}
REPO_ID = "llmplug-tests/tiny-npz"


site, installed = example_site_fixtures(["toy_loader"])  # only this example, installed by pip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def npz_model(tiny, tmp_path_factory) -> Path:
    """The tiny Llama as config.json plus weights.npz (HF names), and no safetensors."""
    return save_as_npz(tiny, tmp_path_factory.mktemp("npz_model"))


def expected(tiny) -> list[list[int]]:
    return [hf_greedy(tiny.hf_model, p, MAX_TOKENS) for p in PROMPTS]


def put_in_hf_cache(cache: Path, repo_id: str, folder: Path) -> Path:
    """Place `folder`'s files in `cache` the way huggingface_hub downloads them: blobs, snapshot links, refs/main."""
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_the_installed_loader_is_chosen_by_load_format_and_generates_like_hf(installed, tiny, npz_model):
    llm = LLM(str(npz_model), **ENGINE)
    [info] = [i for i in llm.llm_engine.registry.infos("llmplug.loaders") if i.name == "npz"]
    assert (info.distribution, info.builtin) == ("llmplug-example-toy-loader", False)
    assert generate_ids(llm, PROMPTS, GREEDY) == expected(tiny)


def test_the_engine_calls_download_model_before_any_worker_starts(installed, npz_model, tmp_path):
    shutil.copy(npz_model / "config.json", tmp_path)  # a model folder without its weights.npz
    with pytest.raises(ModelLoadError, match=r"load.format npz: .*weights.npz does not exist") as error:
        LLM(str(tmp_path), **ENGINE)
    frames = [entry.name for entry in error.traceback]
    assert "download_model" in frames and "load_model" not in frames


def test_a_model_in_no_local_place_is_a_clear_error(installed, tmp_path):
    with pytest.raises(ModelLoadError, match=r"'llmplug-tests/absent' was not found.*not in the Hugging Face cache"):
        LLM("llmplug-tests/absent", download_dir=str(tmp_path), **ENGINE)


def test_models_are_found_in_the_hf_cache_offline(site, tiny, npz_model, tmp_path):
    hub_cache = tmp_path / "hf_home" / "hub"
    put_in_hf_cache(hub_cache, REPO_ID, npz_model)
    [repo] = scan_cache_dir(hub_cache).repos  # the hub's own reader accepts the layout
    [revision] = repo.revisions
    assert repo.repo_id == REPO_ID and {f.file_name for f in revision.files} == {"config.json", "weights.npz"}
    # A fresh interpreter: the hub reads HF_HOME and HF_HUB_OFFLINE when it is imported.
    result = run_python(
        f"""
        import json
        from llmplug import LLM, SamplingParams
        from llmplug.core.errors import ModelLoadError
        llm = LLM({REPO_ID!r}, **{ENGINE!r})
        params = SamplingParams(temperature=0.0, max_tokens={MAX_TOKENS}, ignore_eos=True)
        outs = llm.generate([{{"prompt_token_ids": p}} for p in {PROMPTS!r}], params, use_tqdm=False)
        try:
            LLM("llmplug-tests/absent", **{ENGINE!r})
            missing = None
        except ModelLoadError as error:
            missing = str(error)
        print(json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in outs], "missing": missing}}))
        """,
        site,
        env={"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"},
    )
    assert result["tokens"] == expected(tiny)
    assert "'llmplug-tests/absent' was not found" in result["missing"] and "hf download" in result["missing"]
