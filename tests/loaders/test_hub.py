"""Hub names (`org/name`, `org/name:QUANT`, --hf-file, --revision) resolved from a Hugging Face cache built here in
the hub's own layout, offline: no test touches the network. Downloads are checked by what is asked of the hub."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import openai
import pytest
from huggingface_hub import constants, scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

from llmplug import LLM, SamplingParams
from llmplug.core.config import ModelConfig
from llmplug.core.errors import ConfigError, ModelLoadError
from llmplug.loaders import resolve_load_format
from llmplug.loaders.default_model import resolve_model_path
from llmplug.loaders.hub import HubName, resolve_model_source, resolve_tokenizer_source
from tests.models.tiny_models import save_tiny_llama, train_llama_tokenizer

REPO = "llmplug-tests/tiny-llama"
GGUF_REPO = "llmplug-tests/smol-gguf"
ENGINE = {"dtype": "float32", "max_model_len": 128, "block_size": 16}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The sea is", "One two three"]
QUANTS = ("Q4_1", "Q4_K_M", "Q4_K_S", "Q8_0")


def put_in_hf_cache(cache: Path, repo_id: str, files: dict[str, Path], refs: tuple[str, ...] = ("main",),
                    commit: str | None = None) -> Path:
    """Lay `files` (repo path -> local file) out in `cache` as huggingface_hub downloads them: content-named blobs,
    a snapshot folder of relative links per commit, and refs naming the commit. Returns the snapshot folder."""
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = commit or hashlib.sha1(f"{repo_id}{sorted(files)}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        blob = repo / "blobs" / hashlib.sha256(f"{source.resolve()}:{source.stat().st_size}".encode()).hexdigest()
        if not blob.exists():
            blob.symlink_to(source.resolve())  # a large file (the GGUF) is not copied
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, Path]:
    return {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with a small sentencepiece tokenizer, saved as a model folder."""
    tokenizer = train_llama_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path, tokenizer, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    return path


@pytest.fixture(scope="module")
def cache(tiny_model, tmp_path_factory) -> Path:
    """A hub cache holding REPO (main, and tag v1 at an older commit without the tokenizer) and GGUF_REPO."""
    cache = tmp_path_factory.mktemp("hf_cache") / "hub"
    put_in_hf_cache(cache, REPO, folder_files(tiny_model))
    weights_only = {k: v for k, v in folder_files(tiny_model).items() if not k.startswith(("tokenizer", "special"))}
    put_in_hf_cache(cache, REPO, weights_only, refs=("v1",), commit="1" * 40)
    smol = Path(resolve_model_path("SmolLM2-135M-Instruct"))
    fake = tmp_path_factory.mktemp("fake") / "not-a-model.gguf"
    fake.write_bytes(b"GGUF")  # the choice of a file is under test, not these files' contents
    ggufs = {f"SmolLM2-135M-Instruct-{q}.gguf": smol if q == "Q4_1" else fake for q in QUANTS}
    put_in_hf_cache(cache, GGUF_REPO, ggufs)
    return cache


@pytest.fixture
def offline(monkeypatch):
    """HF_HUB_OFFLINE as huggingface_hub reads it (its constant, set from the environment at import)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def local_llm(tiny_model) -> LLM:
    return LLM(str(tiny_model), **ENGINE)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def resolve(name: str, cache: Path, **fields) -> str:
    return resolve_model_source(ModelConfig(model=name, **fields), str(cache))


def test_the_test_cache_is_one_huggingface_hub_reads(cache):
    repos = {r.repo_id: r for r in scan_cache_dir(cache).repos}
    assert set(repos) == {REPO, GGUF_REPO}
    assert {ref for rev in repos[REPO].revisions for ref in rev.refs} == {"main", "v1"}


@pytest.mark.parametrize("name, parsed", [
    ("org/name", HubName("org/name", None)),
    ("Org/Name-0.5B.v2:q4_k_m", HubName("Org/Name-0.5B.v2", "q4_k_m")),
    ("/abs/path", None), ("C:/models/x", None), ("SmolLM2-135M-Instruct", None), ("a/b/c", None),
])
def test_hub_names_are_org_slash_name_with_an_optional_quant_tag(name, parsed):
    assert HubName.parse(name) == parsed


def test_llm_from_a_hub_name_offline_generates_like_the_local_folder(cache, local_llm, offline, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # the hub's default cache: no --download-dir
    llm = LLM(REPO, **ENGINE)
    assert llm.config.model.model == str(_snapshot(cache, REPO, "main"))
    assert greedy_tokens(llm) == greedy_tokens(local_llm)


def _snapshot(cache: Path, repo: str, ref: str) -> Path:
    folder = cache / repo_folder_name(repo_id=repo, repo_type="model")
    return folder / "snapshots" / (folder / "refs" / ref).read_text()


def test_download_dir_is_the_cache_and_a_local_path_wins(cache, tiny_model, offline, tmp_path, monkeypatch):
    assert resolve(REPO, cache) == str(_snapshot(cache, REPO, "main"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / REPO).mkdir(parents=True)  # a folder named like the repo, relative to the working directory
    assert resolve(REPO, cache) == REPO
    assert resolve(str(tiny_model), cache) == str(tiny_model)
    assert resolve("SmolLM2-135M-Instruct", cache) == resolve_model_path("SmolLM2-135M-Instruct")


def test_an_empty_cache_offline_is_an_error_naming_the_repo(cache, offline, tmp_path):
    with pytest.raises(ModelLoadError, match=rf"'{REPO}' was not found.*revision main is not in the Hugging Face "
                                             rf"cache at {tmp_path}.*HF_HUB_OFFLINE is set.*hf download {REPO}"):
        LLM(REPO, download_dir=str(tmp_path), **ENGINE)
    assert resolve(REPO, cache) == str(_snapshot(cache, REPO, "main"))  # the same name from a cache that has it


def test_revision_picks_the_snapshot_of_a_tag_or_commit_and_an_unknown_one_is_named(cache, offline):
    assert resolve(REPO, cache, revision="v1") == str(_snapshot(cache, REPO, "v1")) != resolve(REPO, cache)
    assert resolve(REPO, cache, revision="1" * 40) == str(_snapshot(cache, REPO, "v1"))
    with pytest.raises(ModelLoadError, match=r"revision v9 is not in the Hugging Face cache.*cached revisions: "
                                             r"main, v1.*HF_HUB_OFFLINE.*--revision v9"):
        LLM(REPO, revision="v9", download_dir=str(cache), **ENGINE)  # vLLM's keyword names
    assert resolve(REPO, cache, revision="main") == str(_snapshot(cache, REPO, "main"))


def test_a_tokenizer_hub_name_resolves_like_the_model(cache, tiny_model, offline):
    config = ModelConfig(model=str(tiny_model), tokenizer=REPO)
    assert resolve_tokenizer_source(config, str(cache)) == str(_snapshot(cache, REPO, "main"))
    # the model's revision applies to its own repo's tokenizer, not to another repo's
    same_repo = ModelConfig(model=REPO, tokenizer=REPO, revision="v1")
    assert resolve_tokenizer_source(same_repo, str(cache)) == str(_snapshot(cache, REPO, "v1"))
    other_repo = ModelConfig(model=f"{GGUF_REPO}:Q4_1", tokenizer=REPO, revision="v1")
    assert resolve_tokenizer_source(other_repo, str(cache)) == str(_snapshot(cache, REPO, "main"))
    assert resolve_tokenizer_source(ModelConfig(model=REPO), str(cache)) is None


def test_a_quant_tag_or_hf_file_picks_the_gguf(cache, offline):
    snapshot = _snapshot(cache, GGUF_REPO, "main")
    for name, fields, file in [
        (f"{GGUF_REPO}:Q4_K_M", {}, "Q4_K_M"), (f"{GGUF_REPO}:q8_0", {}, "Q8_0"),
        (GGUF_REPO, {"hf_file": "SmolLM2-135M-Instruct-Q4_K_S.gguf"}, "Q4_K_S"),
    ]:
        assert resolve(name, cache, **fields) == str(snapshot / f"SmolLM2-135M-Instruct-{file}.gguf")


def test_the_gguf_from_a_hub_name_is_what_the_gguf_loader_reads(cache, offline):
    # The engine on this file is the embedded model's (tests/loaders/test_default_model.py): what is under test is
    # that the cache's link is the file and is taken for a GGUF (building the engine here would add ~30 s).
    path = resolve(f"{GGUF_REPO}:Q4_1", cache)
    assert os.path.samefile(path, resolve_model_path("SmolLM2-135M-Instruct"))
    assert resolve_load_format(path, "auto") == "gguf"


@pytest.mark.parametrize("name, fields, error", [
    (f"{GGUF_REPO}:Q4_K", {}, r"names several \.gguf files \(.*Q4_K_M\.gguf, .*Q4_K_S\.gguf\); pick one"),
    (f"{GGUF_REPO}:Q2_K", {}, r"no \.gguf file of hub repo .* has 'Q2_K'.*Q4_1\.gguf, .*Q8_0\.gguf\)"),
    (GGUF_REPO, {}, r"names several \.gguf files"),
    (GGUF_REPO, {"hf_file": "absent.gguf"}, r"'absent\.gguf' is not in hub repo .*Q4_K_S\.gguf"),
    (f"{GGUF_REPO}:Q8_0", {"hf_file": "x.gguf"}, r"give one of the two"),
])
def test_gguf_choices_that_match_no_single_file_list_the_repos_files(cache, offline, name, fields, error):
    with pytest.raises(ConfigError, match=error):
        resolve(name, cache, **fields)
    assert resolve(f"{GGUF_REPO}:Q4_K_S", cache).endswith("Q4_K_S.gguf")


def test_a_split_gguf_is_a_clear_error_before_any_download(tmp_path, offline):
    part, cache = tmp_path / "part.gguf", tmp_path / "hub"
    part.write_bytes(b"GGUF")
    parts = {f"big-Q4_K_M-0000{i}-of-00002.gguf": part for i in (1, 2)}
    put_in_hf_cache(cache, "llmplug-tests/split", {**parts, "small-Q8_0.gguf": part})
    with pytest.raises(ConfigError, match=r"split GGUF \(big-Q4_K_M-00001-of-00002.gguf, .*00002.gguf\).*merge"):
        resolve("llmplug-tests/split:Q4_K_M", cache)
    assert resolve("llmplug-tests/split:Q8_0", cache).endswith("small-Q8_0.gguf")


def test_a_cached_snapshot_without_weights_is_not_taken_for_the_model(tiny_model, tmp_path, offline):
    cache = tmp_path / "hub"
    put_in_hf_cache(cache, REPO, {"config.json": tiny_model / "config.json"})  # e.g. only a tokenizer fetched
    with pytest.raises(ModelLoadError, match=r"snapshot of revision main .* lacks files it needs"):
        resolve(REPO, cache)


def test_with_the_repos_listing_cached_a_quant_not_downloaded_is_missing_and_a_bad_choice_is_wrong(tmp_path, offline):
    # `hf download org/name --include "*Q4_1*"` leaves one .gguf and the repo's whole listing (trees/<commit>.json)
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    cache, smol = tmp_path / "hub", Path(resolve_model_path("SmolLM2-135M-Instruct"))
    snapshot = put_in_hf_cache(cache, GGUF_REPO, {"SmolLM2-135M-Instruct-Q4_1.gguf": smol})
    listing = {f"SmolLM2-135M-Instruct-{q}.gguf": TreeCacheEntry(size=1, blob_id=q) for q in QUANTS}
    write_tree_cache(str(snapshot.parent.parent), snapshot.name, listing)
    with pytest.raises(ModelLoadError, match=r"snapshot of revision main .* lacks files it needs.*HF_HUB_OFFLINE"):
        resolve(f"{GGUF_REPO}:Q4_K_M", cache)
    with pytest.raises(ConfigError, match=r"names several \.gguf files \(.*Q4_K_M\.gguf, .*Q4_K_S\.gguf\)"):
        resolve(f"{GGUF_REPO}:Q4_K", cache)  # wrong whatever the hub holds: no "could not be asked"
    assert resolve(f"{GGUF_REPO}:Q4_1", cache) == str(snapshot / "SmolLM2-135M-Instruct-Q4_1.gguf")


# ---------------------------------------------------------------- downloads: what is asked of the hub


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """huggingface_hub's model_info and snapshot_download replaced: a repo listing in, the calls recorded."""
    calls = []

    def install(listing: list[str]) -> list[dict]:
        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, revision=None: SimpleNamespace(
            siblings=[SimpleNamespace(rfilename=f) for f in listing]))

        def snapshot_download(repo, **kwargs):
            calls.append({"repo": repo, **kwargs})
            return str(tmp_path / "snapshot")

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        return calls

    return install


LISTING = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md",
           "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
           "pytorch_model.bin", "consolidated.safetensors", "original/consolidated.00.pth", "onnx/model.onnx",
           "flax_model.msgpack", "tf_model.h5", "model-Q4_K_M.gguf"]


def test_a_download_takes_only_the_files_the_engine_reads(fake_hub, tmp_path):
    calls = fake_hub(LISTING)
    path = resolve_model_source(ModelConfig(model="org/model", revision="v2"), str(tmp_path / "cache"))
    [call] = calls
    assert path == str(tmp_path / "snapshot") and call["repo"] == "org/model" and call["revision"] == "v2"
    assert call["cache_dir"] == str(tmp_path / "cache")
    assert sorted(call["allow_patterns"]) == sorted([
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"])


def test_a_download_without_safetensors_takes_the_bin_files_and_a_tokenizer_only_the_tokenizer(fake_hub, tmp_path):
    calls = fake_hub([f for f in LISTING if ".safetensors" not in f])
    resolve_model_source(ModelConfig(model="org/model"), None)
    resolve_tokenizer_source(ModelConfig(model=str(tmp_path), tokenizer="org/model"), None)
    weights, tokenizer = calls
    assert "pytorch_model.bin" in weights["allow_patterns"] and weights["cache_dir"] is None
    assert sorted(tokenizer["allow_patterns"]) == ["config.json", "generation_config.json", "tokenizer.json",
                                                   "tokenizer_config.json"]


def test_a_download_of_a_quant_takes_that_gguf_only(fake_hub, tmp_path):
    calls = fake_hub(LISTING)
    path = resolve_model_source(ModelConfig(model="org/model:Q4_K_M"), None)
    assert calls[0]["allow_patterns"] == ["model-Q4_K_M.gguf"] and path == str(tmp_path / "snapshot" /
                                                                               "model-Q4_K_M.gguf")


def test_a_network_failure_names_the_repo_and_the_cause(monkeypatch, tmp_path, cache):
    from huggingface_hub.utils import httpx

    def unreachable(self, repo, revision=None):
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    with pytest.raises(ModelLoadError, match=r"'org/model' was not found.*downloading it failed: ConnectError: "
                                             r"\[Errno -2\] Name or service not known"):
        resolve_model_source(ModelConfig(model="org/model"), str(tmp_path))
    assert resolve(REPO, cache) == str(_snapshot(cache, REPO, "main"))  # a cached repo needs no network


# ---------------------------------------------------------------- `llmplug serve org/name`


def test_serve_a_hub_name_offline_answers_and_lists_the_name(cache, local_llm):
    from tests.entrypoints.openai.conftest import free_port
    from tests.entrypoints.openai.test_serve_cli import wait_until_healthy

    port = free_port()
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "llmplug.entrypoints.cli", "serve", REPO, "--dtype", "float32", "--max-model-len",
         "128", "--port", str(port), "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_until_healthy(port, process)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [REPO]
        answer = client.completions.create(model=REPO, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
        [expected] = local_llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
        assert answer.choices[0].text == expected.outputs[0].text
    finally:
        process.terminate()
        process.wait(60)
