"""Models named by a Hugging Face hub id: `org/name`, `org/name:Q4_K_M` (a GGUF quantization), `--hf-file`.

`resolve_model_source` and `resolve_tokenizer_source` turn the model (and tokenizer) of a ModelConfig into
local paths once, in `prepare_config`, before any loader or worker sees them. The order:

1. an existing local path or an embedded model's short name (`default_model.resolve_model_path`) as it is;
2. a name that is not shaped like a hub id, unchanged (the loader reports it);
3. the revision's snapshot in the Hugging Face cache (`load.download_dir`, else the hub's default), with no
   network call, when it holds every file the engine needs;
4. else a download of only those files through `huggingface_hub` (its tqdm bar; it reads `HF_TOKEN`,
   `HF_ENDPOINT`, `HF_HUB_OFFLINE` itself), or an error naming the repo, the revision and what is missing.

What the engine needs is a plan over the repo's file names: the config and tokenizer files plus the
safetensors weights (else the .bin ones), or one .gguf file; other formats (.pth, ONNX, Flax, TF) are skipped.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmplug.core.errors import ConfigError, ModelLoadError
from llmplug.loaders.default_model import resolve_model_path

if TYPE_CHECKING:
    from llmplug.core.config import ModelConfig

__all__ = ["HubName", "resolve_model_source", "resolve_tokenizer_source"]

logger = logging.getLogger(__name__)

# org/name, optionally :TAG; the characters the hub allows in ids (huggingface_hub.utils.validate_repo_id)
_HUB_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<tag>[\w.-]+))?$")
# config, tokenizer, chat template and pooling files: small, and every one the engine may read
_METADATA = ("*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja", "spiece.model", "sentencepiece*.model")
_SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# weight formats of other frameworks: never downloaded, whatever the repo holds
_OTHER_FORMATS = ("*.pth", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.tflite", "*.mlmodel", "*.ot", "*.gguf")


@dataclass(frozen=True, slots=True)
class HubName:
    """A model name shaped like a hub id: `repo` ("org/name") and the GGUF quantization `tag` after a colon."""

    repo: str
    tag: str | None

    @classmethod
    def parse(cls, name: str) -> "HubName | None":
        """The hub id in `name`, or None when `name` is not shaped like one."""
        match = _HUB_NAME.match(name)
        return cls(match["repo"], match["tag"]) if match else None


@dataclass(frozen=True, slots=True)
class _Plan:
    """The repo files the engine needs (paths in the repo), and the one it is given: a .gguf file or the folder."""

    files: tuple[str, ...]
    gguf: str | None = None

    def local_path(self, snapshot: str) -> str:
        return os.path.join(snapshot, self.gguf) if self.gguf else snapshot


@dataclass(frozen=True, slots=True)
class _CachedSnapshot:
    """A revision's snapshot folder in the cache and the repo's files as the cache knows them."""

    folder: str
    listing: tuple[str, ...]
    complete: bool  # the listing is the repo's (a tree snapshot_download cached), not only what was downloaded


def resolve_model_source(model_config: "ModelConfig", cache_dir: str | None) -> str:
    """The local path of `model_config.model`: a local path or embedded model as it is, a hub id's files in the HF
    cache (downloaded there when missing and online). ConfigError / ModelLoadError name the repo and revision."""
    name = model_config.model
    path = resolve_model_path(name)
    hub_name = HubName.parse(name)
    if os.path.exists(path) or hub_name is None:
        return path
    return _resolve(hub_name, model_config.revision, model_config.hf_file, cache_dir, tokenizer_only=False)


def resolve_tokenizer_source(model_config: "ModelConfig", cache_dir: str | None) -> str | None:
    """`model_config.tokenizer` as a local path, resolved like the model (tokenizer files only); None stays None.

    The model's revision applies when the tokenizer is the model's own repo; another repo's tokenizer comes
    from its default branch."""
    name = model_config.tokenizer
    hub_name = HubName.parse(name) if name else None
    if name is None or os.path.exists(name) or hub_name is None:
        return name
    same_repo = HubName.parse(model_config.model)
    revision = model_config.revision if same_repo and same_repo.repo == hub_name.repo else None
    return _resolve(hub_name, revision, None, cache_dir, tokenizer_only=True)


def _resolve(name: HubName, revision: str | None, hf_file: str | None, cache_dir: str | None,
             tokenizer_only: bool) -> str:
    """The local path of hub model `name`: from the cache when it holds the plan, else downloaded."""
    if name.tag and hf_file:
        raise ConfigError(f"model {name.repo}:{name.tag} and model.hf_file {hf_file!r}: give one of the two")
    cached = _cached_snapshot(name.repo, revision, cache_dir)
    found, choice_error = _from_cache(name, hf_file, cached, tokenizer_only) if cached else (None, None)
    if found is not None:
        logger.info("%s (revision %s): from the Hugging Face cache, %s", name.repo, revision or "main", found)
        return found
    try:
        return _download(name, revision, hf_file, cache_dir, tokenizer_only, cached)
    except ModelLoadError as error:
        if choice_error is None:
            raise
        raise ConfigError(f"{choice_error} - of the files cached in {cached.folder}; the hub, which may hold "
                          f"more, could not be asked ({error.__cause__})") from error


def _from_cache(name: HubName, hf_file: str | None, cached: _CachedSnapshot,
                tokenizer_only: bool) -> tuple[str | None, ConfigError | None]:
    """The local path when the cached snapshot holds every file the plan takes, else None; and the choice's
    error when the cache's files match no single .gguf (the hub, which may hold more files, decides)."""
    try:
        plan = _plan(name, hf_file, cached.listing, tokenizer_only)
    except ConfigError as error:
        if cached.complete:  # the repo's own listing: the choice is wrong, a download would not help
            raise
        return None, error
    if not (cached.complete or tokenizer_only or _has_weights(plan)):
        return None, None  # only some files were fetched (a tokenizer, a config): the weights are on the hub
    if all(os.path.exists(os.path.join(cached.folder, f)) for f in plan.files):
        return plan.local_path(cached.folder), None
    return None, None


def _cache_root(cache_dir: str | None) -> str:
    from huggingface_hub import constants

    return str(Path(cache_dir or constants.HF_HUB_CACHE).expanduser().resolve())


def _cached_snapshot(repo: str, revision: str | None, cache_dir: str | None) -> _CachedSnapshot | None:
    """The cached snapshot of `repo` at `revision` (a branch, tag or commit; default main), or None; no network."""
    from huggingface_hub import errors, get_cached_repo_tree

    snapshot = _cached_revision(repo, revision, cache_dir)
    if snapshot is None:
        return None
    try:
        tree = get_cached_repo_tree(repo, revision=revision, cache_dir=_cache_root(cache_dir))
        return _CachedSnapshot(snapshot, tuple(f.path for f in tree), complete=True)
    except errors.CachedRepoTreeNotFoundError:  # files fetched one by one (hf_hub_download): only they are known
        root = Path(snapshot)
        files = tuple(str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file())
        return _CachedSnapshot(snapshot, files, complete=False)


def _cached_revision(repo: str, revision: str | None, cache_dir: str | None) -> str | None:
    """The snapshot folder the cache holds for `repo` at `revision` (refs/<revision>, or a commit's folder)."""
    revision_info = next((r for r in _cached_revisions(repo, cache_dir) if _names(r, revision or "main")), None)
    return str(revision_info.snapshot_path) if revision_info else None


def _names(revision_info, revision: str) -> bool:
    """True when the cached revision is `revision`: one of its refs (branch, tag) or its commit."""
    return revision in revision_info.refs or revision_info.commit_hash == revision


def _cached_revisions(repo: str, cache_dir: str | None) -> list:
    """The cached revisions (huggingface_hub's CachedRevisionInfo) of model repo `repo`; [] when none."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        cache = scan_cache_dir(_cache_root(cache_dir))
    except CacheNotFound:
        return []
    repos = [r for r in cache.repos if r.repo_id == repo and r.repo_type == "model"]
    return sorted((rev for r in repos for rev in r.revisions), key=lambda rev: rev.commit_hash)


# ---------------------------------------------------------------- the files the engine needs


def _plan(name: HubName, hf_file: str | None, listing: tuple[str, ...], tokenizer_only: bool) -> _Plan:
    """The files to take from a repo holding `listing`; ConfigError when a GGUF choice matches no single file."""
    metadata = tuple(f for f in listing if _matches(f, _METADATA))
    if tokenizer_only:
        return _Plan(metadata)
    if name.tag or hf_file:
        return _gguf_plan(name, hf_file, listing)
    top_level = [f for f in listing if "/" not in f]
    for pattern in ("*.safetensors", "*.bin"):
        weights = _weights(top_level, pattern)
        if weights:
            return _Plan(metadata + tuple(weights))
    if any(f.lower().endswith(".gguf") for f in listing):
        return _gguf_plan(name, None, listing)
    # No weights the built-in loaders read (a plugin's format, or a config-only repo): all but other frameworks'.
    return _Plan(tuple(f for f in listing if not _matches(f, _OTHER_FORMATS)))


def _has_weights(plan: _Plan) -> bool:
    """True when the plan takes a file beside the config and tokenizer ones (weights of some format)."""
    return any(not _matches(f, _METADATA) for f in plan.files)


def _weights(files: list[str], pattern: str) -> list[str]:
    """The checkpoint files matching `pattern`; Mistral's `consolidated*` duplicates only when nothing else."""
    weights = [f for f in files if fnmatch.fnmatch(f.lower(), pattern) and f != "training_args.bin"]
    hf_named = [f for f in weights if not f.startswith("consolidated")]
    return hf_named or weights


def _matches(path: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(path.lower(), pattern) for pattern in patterns)


def _gguf_plan(name: HubName, hf_file: str | None, listing: tuple[str, ...]) -> _Plan:
    """The one .gguf file `hf_file` names, or whose name holds `name.tag`, or the repo's only one."""
    ggufs = sorted(f for f in listing if f.lower().endswith(".gguf"))
    shown = ", ".join(ggufs) or "none"
    if hf_file:
        if hf_file not in listing:
            raise ConfigError(f"model.hf_file {hf_file!r} is not in hub repo {name.repo} (its .gguf files: {shown})")
        chosen = [hf_file]
    elif name.tag:
        chosen = _by_tag(name.tag, ggufs)
        if not chosen:
            raise ConfigError(f"no .gguf file of hub repo {name.repo} has {name.tag!r} in its name "
                              f"(its .gguf files: {shown})")
    else:
        chosen = ggufs
    models = sorted({_SPLIT_GGUF.sub("", f) for f in chosen})
    if len(models) > 1:
        raise ConfigError(f"hub repo {name.repo}{':' + name.tag if name.tag else ''} names several .gguf files "
                          f"({', '.join(chosen)}); pick one with {name.repo}:QUANT (e.g. Q4_K_M) or --hf-file NAME")
    parts = [f for f in chosen if _SPLIT_GGUF.search(f)]
    if parts:
        raise ConfigError(f"hub repo {name.repo}: {chosen[0]} is one part of a split GGUF ({', '.join(parts)}); "
                          "llmplug's GGUF loader reads single files: merge the parts with "
                          "`llama-gguf-split --merge` into a local file and pass that path, or pick another file")
    return _Plan((chosen[0],), gguf=chosen[0])


def _by_tag(tag: str, ggufs: list[str]) -> list[str]:
    """The files whose name holds `tag` (any case); those holding it as a whole word first (Q4_0, not Q4_0_4_4)."""
    holding = [f for f in ggufs if tag.lower() in os.path.basename(f).lower()]
    word = re.compile(rf"(?<![a-z0-9]){re.escape(tag.lower())}(?![a-z0-9_])")
    whole = [f for f in holding if word.search(os.path.basename(f).lower())]
    return whole or holding


# ---------------------------------------------------------------- download


def _download(name: HubName, revision: str | None, hf_file: str | None, cache_dir: str | None,
              tokenizer_only: bool, cached: _CachedSnapshot | None) -> str:
    """List the repo on the hub, then download the plan's files into the cache; errors say what is missing."""
    from huggingface_hub import HfApi, snapshot_download

    try:
        info = HfApi().model_info(name.repo, revision=revision)
        plan = _plan(name, hf_file, tuple(s.rfilename for s in info.siblings or ()), tokenizer_only)
        logger.info("%s (revision %s): downloading %d files into %s", name.repo, revision or "main",
                    len(plan.files), _cache_root(cache_dir))
        folder = snapshot_download(name.repo, revision=revision, cache_dir=cache_dir, allow_patterns=list(plan.files))
    except _hub_errors() as error:
        raise _unavailable(name, revision, cache_dir, cached, error) from error
    return plan.local_path(folder)


def _hub_errors() -> tuple[type[Exception], ...]:
    """What huggingface_hub raises when the hub cannot give a repo: HTTP errors, offline mode, the network, disk."""
    from huggingface_hub import errors
    from huggingface_hub.utils import httpx

    return errors.HfHubHTTPError, errors.OfflineModeIsEnabled, httpx.HTTPError, OSError


def _unavailable(name: HubName, revision: str | None, cache_dir: str | None, cached: _CachedSnapshot | None,
                 error: Exception) -> Exception:
    """The error for a hub model that is neither (fully) in the cache nor downloadable, naming what is missing."""
    from huggingface_hub import errors

    if isinstance(error, errors.RevisionNotFoundError):
        return ConfigError(f"model.revision {revision!r} does not exist in hub repo {name.repo}: {error}")
    where = _cache_root(cache_dir)
    revision_text = f"revision {revision or 'main'}"
    if cached is None:
        known = sorted({ref for r in _cached_revisions(name.repo, cache_dir) for ref in r.refs})
        have = f"; cached revisions: {', '.join(known)}" if known else ""
        missing = f"{revision_text} is not in the Hugging Face cache at {where}{have}"
    else:
        missing = f"its snapshot of {revision_text} in the Hugging Face cache at {cached.folder} lacks files it needs"
    if isinstance(error, errors.OfflineModeIsEnabled):
        reason = "HF_HUB_OFFLINE is set, so it was not downloaded"
    elif isinstance(error, errors.RepositoryNotFoundError):
        reason = f"the hub has no repo {name.repo} this token may read (gated or private: set HF_TOKEN): {error}"
    else:
        reason = f"downloading it failed: {type(error).__name__}: {error}"
    return ModelLoadError(
        f"model {name.repo!r} was not found: it is not a local file or directory, {missing}, and {reason}. "
        f"Download it with network access (e.g. `hf download {name.repo}`"
        f"{' --revision ' + revision if revision else ''}), pass --download-dir where it is cached, "
        "or pass a local directory."
    )
