"""load_config: defaults < kwargs < file < flags (by default), then plugin hooks, then one validation that names
the field, value and source of every error."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from llmplug.core.config.files import read_config_file
from llmplug.core.config.keys import ALIASES, FIELD_FLAGS, FIELD_PATHS, FLAG_PATHS, SECTIONS
from llmplug.core.config.schema import EngineConfig, PluginConfig
from llmplug.core.errors import ConfigError, PluginError

SOURCE_ORDER: tuple[str, ...] = ("kwargs", "file", "cli")
HOOK_SOURCE = "hook llmplug_adjust_config"


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """A validated EngineConfig and, for each dotted field, where its value came from."""

    config: EngineConfig
    sources: dict[str, str]


@dataclass(frozen=True, slots=True)
class _Setting:
    """One value from one source, with the key as the user spelled it (for duplicate reports)."""

    value: Any
    source: str
    key: str


def load_config(
    *,
    kwargs: Mapping[str, Any] | None = None,
    file: str | Path | None = None,
    cli: Mapping[str, Any] | None = None,
    apply_hooks: bool = True,
    order: Sequence[str] = SOURCE_ORDER,
) -> ResolvedConfig:
    """Merge defaults and the given sources (later in `order` wins), run plugin hooks, validate.

    `order` lists the sources lowest-precedence first: the CLI keeps the default kwargs < file <
    cli; `LLM(config=path, **kwargs)` passes ("file", "kwargs", "cli") so its keyword arguments win.
    """
    if sorted(order) != sorted(SOURCE_ORDER):
        raise ConfigError(
            f"load_config(order={tuple(order)!r}): list each of {SOURCE_ORDER} once, lowest precedence first"
        )
    readers = {
        "kwargs": lambda: _kwargs_settings(kwargs),
        "file": lambda: _file_settings(file),
        "cli": lambda: _cli_settings(cli),
    }
    merged: dict[str, _Setting] = {}
    for name in order:
        merged.update(readers[name]())
    nested, sources = _nest(merged)
    if apply_hooks:
        _run_hooks(nested, sources)
    return ResolvedConfig(_validate(EngineConfig, nested, sources), sources)


def _kwargs_settings(kwargs: Mapping[str, Any] | None) -> dict[str, _Setting]:
    return _settings_from(kwargs or {}, "kwargs", lambda key, path: "kwargs")


def _file_settings(file: str | Path | None) -> dict[str, _Setting]:
    if file is None:
        return {}
    label = f"file {file}"
    return _settings_from(read_config_file(file), label, lambda key, path: label)


def _cli_settings(cli: Mapping[str, Any] | None) -> dict[str, _Setting]:
    # Keys are flags as typed (`--gpu-memory-utilization`), so the source names that very flag;
    # plain keys (aliases, dotted) are named by their field's primary flag.
    def label(key: str, path: str | None) -> str:
        if key.startswith("-"):
            return f"flag {key}"
        return f"flag {FIELD_FLAGS[path][0]}" if path else "flags"

    return _settings_from(cli or {}, "flags", label)


def _settings_from(data: Any, where: str, label: Callable[[str, str | None], str]) -> dict[str, _Setting]:
    """Flatten one source's keys (sections, aliases, dotted keys, flags) to dotted fields."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config from {where} must be a mapping of keys to values, got {type(data).__name__}")
    settings: dict[str, _Setting] = {}
    for key, value in data.items():
        for path, spelled, item in _expand(str(key), value, label(str(key), None)):
            _put(settings, path, _Setting(item, label(spelled, path), spelled), where)
    return settings


def _expand(key: str, value: Any, where: str) -> list[tuple[str, str, Any]]:
    """(dotted field, key as spelled, value) for one top-level key of a source."""
    if key in SECTIONS and (value is None or isinstance(value, (Mapping, BaseModel))):
        return [(f"{key}.{name}", f"{key}.{name}", item) for name, item in _section_items(key, value, where)]
    if key in SECTIONS and key not in ALIASES:
        raise ConfigError(
            f"{key} = {value!r} (from {where}): section '{key}' must be a mapping of its fields, e.g. {key}: {{...}}"
        )
    return [(_path_of(key, where), key, value)]


def _section_items(section: str, value: Mapping[str, Any] | BaseModel | None, where: str) -> list[tuple[str, Any]]:
    if isinstance(value, BaseModel):  # a section object: only what its author set overrides lower sources
        value = value.model_dump(exclude_unset=True)
    items = [(str(name), item) for name, item in (value or {}).items()]
    for name, _ in items:
        if name not in SECTIONS[section].model_fields:
            raise _unknown_key(f"{section}.{name}", where, _section_paths(section))
    return items


def _section_paths(section: str) -> list[str]:
    return [f"{section}.{name}" for name in SECTIONS[section].model_fields]


def _path_of(key: str, where: str) -> str:
    if key.startswith("-"):
        if key in FLAG_PATHS:
            return FLAG_PATHS[key]
        raise _unknown_key(key, where, list(FLAG_PATHS))
    if key in ALIASES:
        return ALIASES[key]
    if key in FIELD_PATHS:
        return key
    raise _unknown_key(key, where, [*SECTIONS, *ALIASES, *FIELD_PATHS])


def _unknown_key(key: str, where: str, candidates: list[str]) -> ConfigError:
    """An unknown-key error with the closest valid keys as a suggestion."""
    by_name = [path for path in FIELD_PATHS if path.split(".")[1] == key]  # a field name without its section
    close = by_name or difflib.get_close_matches(key, candidates, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "see docs/config.md for every key"
    return ConfigError(f"unknown config key {key!r} (from {where}); {hint}")


def _put(settings: dict[str, _Setting], path: str, setting: _Setting, where: str) -> None:
    if path in settings and settings[path].key != setting.key:
        raise ConfigError(
            f"{path} is set twice in {where} (as {settings[path].key!r} and {setting.key!r}); keep one of them"
        )
    settings[path] = setting


def _nest(merged: dict[str, _Setting]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The full config as nested plain dicts (defaults filled in, so hooks see every field) and sources."""
    nested = EngineConfig().model_dump()
    sources = dict.fromkeys(FIELD_PATHS, "default")
    for path, setting in merged.items():
        section, name = path.split(".")
        nested[section][name] = setting.value
        sources[path] = setting.source
    return nested, sources


def _run_hooks(nested: dict[str, Any], sources: dict[str, str]) -> None:
    """Let `llmplug_adjust_config` hooks edit the merged dict; the fields they change name the hook as source.

    The hooks are those of the registry this very config builds (its allow-list), not the process's: two
    configs loaded in one process never see each other's plugins.
    """
    from llmplug.core.plugins import PluginRegistry  # lazy: plugins imports config

    # The allow-list decides which plugins' hooks run, so it is validated and applied first.
    plugin_config = _validate(PluginConfig, nested["plugins"], sources, prefix="plugins")
    try:
        registry = PluginRegistry.from_config(plugin_config)
    except PluginError as exc:  # e.g. a malformed plugins.prefer key: say which source set it
        where = ", ".join(sorted({sources["plugins.enabled"], sources["plugins.prefer"]} - {"default"}))
        raise ConfigError(f"{exc} (plugins config from {where or 'default'})") from None
    before = copy.deepcopy(nested)
    registry.hook_manager().hook.llmplug_adjust_config(config=nested)
    _attribute_changes(before, nested, sources)


def _attribute_changes(before: dict[str, Any], after: dict[str, Any], sources: dict[str, str]) -> None:
    missing = object()
    for section in after.keys() | before.keys():
        if section not in SECTIONS:
            raise _unknown_key(str(section), HOOK_SOURCE, list(SECTIONS))
        old, new = before.get(section) or {}, after.get(section) or {}
        if not isinstance(new, Mapping):
            continue  # validation reports it against the section
        for name in old.keys() | new.keys():
            if name not in SECTIONS[section].model_fields:
                raise _unknown_key(f"{section}.{name}", HOOK_SOURCE, _section_paths(section))
            if old.get(name, missing) != new.get(name, missing):
                sources[f"{section}.{name}"] = HOOK_SOURCE


_ModelT = TypeVar("_ModelT", bound=BaseModel)


def _validate(cls: type[_ModelT], data: Any, sources: dict[str, str], prefix: str = "") -> _ModelT:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe_error(err, sources, prefix) for err in exc.errors())) from None


def _describe_error(err: Any, sources: dict[str, str], prefix: str) -> str:
    """'cache.block_size = -3 (from file c.yaml): Input should be greater than 0'."""
    loc = [prefix, *map(str, err["loc"])] if prefix else list(map(str, err["loc"]))
    path = ".".join(loc[:2])
    where = path + "".join(f"[{part}]" for part in loc[2:])
    return f"{where or 'config'} = {err['input']!r} (from {sources.get(path, 'default')}): {err['msg']}"
