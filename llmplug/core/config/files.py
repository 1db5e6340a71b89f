"""Config files: YAML, TOML or JSON into a dict, with errors that name the file and line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmplug.core.errors import ConfigError


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a .yaml/.yml, .toml or .json config file into a dict; errors name the file and line."""
    path = Path(path)
    parse = _FILE_PARSERS.get(path.suffix.lower())
    if parse is None:
        raise ConfigError(f"config file {path}: unknown extension {path.suffix!r}; use .yaml, .yml, .toml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror}); check the path") from None
    data = parse(text, path)
    if data is None:  # an empty (or all-comment) YAML file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of config keys at the top, got {type(data).__name__}"
        )
    return data


def _parse_yaml(text: str, path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None


def _parse_toml(text: str, path: Path) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - 3.10 only
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message ends with "(at line L, column C)"
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = f"line {exc.lineno}, column {exc.colno}"
        raise ConfigError(f"config file {path} is not valid JSON at {at}: {exc.msg}") from None


_FILE_PARSERS: dict[str, Callable[[str, Path], Any]] = {
    ".yaml": _parse_yaml,
    ".yml": _parse_yaml,
    ".toml": _parse_toml,
    ".json": _parse_json,
}
