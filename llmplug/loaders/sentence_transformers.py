"""A sentence-transformers model folder read as the engine needs it, so it embeds as sentence-transformers does.

`modules.json` lists the modules that run after the transformer: `Pooling` (its `config.json` says
which pooling: CLS, mean or last token), `Normalize` (L2). `sentence_bert_config.json` holds the
longest input (`max_seq_length`, which caps the context length) and `do_lower_case`. Both layouts
are read: the hub's classic one (`sentence_transformers.models.Pooling`, one `pooling_mode_*` flag per
mode) and sentence-transformers 6's (`sentence_transformers.<area>.modules.<file>.Pooling`, a
`pooling_mode` name; the longest input in the tokenizer's `model_max_length`). A module or
pooling mode llmplug does not implement (Dense, max pooling, several modes at once, ...) is an
error naming it, never silently skipped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from llmplug.core.errors import ModelLoadError

__all__ = ["SentenceTransformersConfig", "is_sentence_transformers_folder", "read_sentence_transformers"]

_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")  # class names, whatever module path a version saves
# 1_Pooling/config.json mode (classic flag or sentence-transformers 6 name) -> llmplug pooling type (PoolingType)
_POOLING_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
    "cls": "CLS",
    "mean": "MEAN",
    "lasttoken": "LAST",
}


@dataclass(frozen=True, slots=True)
class SentenceTransformersConfig:
    """What a sentence-transformers folder says about pooling and inputs."""

    pooling_type: str | None  # "CLS", "MEAN" or "LAST"; None: the folder has no Pooling module
    normalize: bool  # a Normalize module follows the pooling
    max_seq_length: int | None  # longer inputs are truncated by sentence-transformers; llmplug refuses them
    do_lower_case: bool  # sentence-transformers lowercases the text before tokenizing


def is_sentence_transformers_folder(path: str) -> bool:
    """True when `path` is a directory with a modules.json."""
    return os.path.isfile(os.path.join(path, "modules.json"))


def read_sentence_transformers(path: str) -> SentenceTransformersConfig | None:
    """The folder's sentence-transformers settings; None when it is not such a folder."""
    if not is_sentence_transformers_folder(path):
        return None
    modules = _read_json(path, "modules.json")
    unknown = [m.get("type") for m in modules if _module_kind(m) not in _KNOWN_MODULES]
    if unknown:
        raise ModelLoadError(
            f"{path}: sentence-transformers modules {unknown} are not supported (only Transformer, Pooling, "
            "Normalize); remove them from modules.json if the model can do without them"
        )
    pooling = next((m for m in modules if _module_kind(m) == "Pooling"), None)
    bert_config = _read_json(path, "sentence_bert_config.json", missing_ok=True) or {}
    return SentenceTransformersConfig(
        pooling_type=_pooling_type(path, pooling["path"]) if pooling is not None else None,
        normalize=any(_module_kind(m) == "Normalize" for m in modules),
        max_seq_length=bert_config.get("max_seq_length"),
        do_lower_case=bool(bert_config.get("do_lower_case", False)),
    )


def _module_kind(module: dict[str, Any]) -> str | None:
    """A modules.json entry's class name when it is one of sentence-transformers' own, else None."""
    kind = str(module.get("type", ""))
    return kind.rsplit(".", 1)[-1] if kind.startswith("sentence_transformers.") else None


def _pooling_type(path: str, folder: str) -> str:
    config = _read_json(path, os.path.join(folder, "config.json"))
    named = config.get("pooling_mode")  # sentence-transformers 6: a name or a list of names
    if named is not None:
        modes = [named] if isinstance(named, str) else list(named)
    else:
        modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if config.get("include_prompt") is False:
        modes.append("include_prompt=false")
    if len(modes) != 1 or _POOLING_MODES.get(modes[0]) is None:
        raise ModelLoadError(
            f"{path}: sentence-transformers pooling {modes or 'none'} is not supported; llmplug pools with exactly "
            "one of cls, mean, lasttoken (pooling_mode_cls_token, pooling_mode_mean_tokens, pooling_mode_lasttoken)"
        )
    return _POOLING_MODES[modes[0]]


def _read_json(path: str, name: str, missing_ok: bool = False) -> Any:
    file = os.path.join(path, name)
    if missing_ok and not os.path.isfile(file):
        return None
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"cannot read the sentence-transformers file {file}: {error}") from error
