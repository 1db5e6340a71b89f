"""CLI flags of every EngineConfig field, generated from the schema, and turning parsed flags into a config.

Flag names come from `llmplug.core.config.FIELD_FLAGS` (the field name with dashes, or the vLLM alias
or `--<section>-<field>` where a bare name would be ambiguous), plus the vLLM alias flags. Every flag
keeps argparse's `SUPPRESS` default, so only flags the user typed become a config source.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from llmplug.core.config import FIELD_FLAGS, SECTIONS, ResolvedConfig, is_bool_field, load_config
from llmplug.core.errors import ConfigError

# Namespace attribute where the flag actions record, per dotted field, the flag spelling used.
_TYPED_FLAGS = "_llmplug_config_flags"


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> argparse.ArgumentParser:
    """Add `--config FILE` and one flag (plus vLLM aliases) per config field, grouped by section."""
    parser.add_argument("--config", metavar="FILE", help="YAML, TOML or JSON config file; flags override it.")
    if model_positional:  # `llmplug serve MODEL`: the same field as --model
        parser.add_argument("model_tag", nargs="?", metavar="MODEL", action=_ModelTag, default=argparse.SUPPRESS,
                            help="Model directory, .gguf file or embedded model name (same as --model).")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} config", cls.__doc__)
        for name, field in cls.model_fields.items():
            _add_field_flag(group, f"{section}.{name}", field)
    return parser


def config_from_args(args: argparse.Namespace, extra_kwargs: dict[str, Any] | None = None) -> ResolvedConfig:
    """Resolve the config from parsed flags, `--config` and `extra_kwargs` (kwargs < file < flags)."""
    typed: dict[str, str] = getattr(args, _TYPED_FLAGS, {})
    cli = {flag: getattr(args, path) for path, flag in typed.items()}
    return load_config(kwargs=extra_kwargs, file=getattr(args, "config", None), cli=cli)


def _add_field_flag(group: Any, path: str, field: FieldInfo) -> None:
    flags = FIELD_FLAGS[path]
    help_text = _help(field)
    if is_bool_field(path):
        group.add_argument(*flags, dest=path, action=_BoolFlag, default=argparse.SUPPRESS, help=help_text)
        return
    group.add_argument(*flags, dest=path, action=_ValueFlag, default=argparse.SUPPRESS,
                       metavar=_metavar(path.split('.')[1], field), help=help_text)


def _help(field: FieldInfo) -> str:
    default = field.get_default(call_default_factory=True)
    shown = "" if default is None else f" Default: {default!r}."  # None fields say their default in words
    return f"{field.description or ''}{shown}".replace("%", "%%")  # argparse %-formats help


def _metavar(name: str, field: FieldInfo) -> str:
    kind = _without_none(field.annotation)
    if typing.get_origin(kind) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(kind))) + "}"
    if typing.get_origin(kind) is dict:
        return "JSON"
    if typing.get_origin(kind) is list:
        return "A,B,..."
    return name.upper() if kind is str else getattr(kind, "__name__", "VALUE").upper()


def _without_none(annotation: Any) -> Any:
    """`int | None` -> int; any other annotation unchanged."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return annotation
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return args[0] if len(args) == 1 else annotation


def _record(namespace: argparse.Namespace, path: str, flag: str) -> None:
    typed = getattr(namespace, _TYPED_FLAGS, None)
    if typed is None:
        typed = {}
        setattr(namespace, _TYPED_FLAGS, typed)
    typed[path] = flag


def parse_flag_value(path: str, raw: str, flag: str) -> Any:
    """Convert a flag's text to the field's type: JSON for dicts, commas for lists, 'none' for unset."""
    field = SECTIONS[path.split(".")[0]].model_fields[path.split(".")[1]]
    kind = _without_none(field.annotation)
    if kind is not field.annotation and raw.lower() in ("none", "null"):
        return None
    if typing.get_origin(kind) is dict:
        return _parse_json_flag(raw, flag)
    if typing.get_origin(kind) is list:
        return [item.strip() for item in raw.split(",") if item.strip()]
    try:
        return TypeAdapter(kind).validate_strings(raw)
    except ValidationError:  # keep the text: validation reports it with the flag as source
        return raw


def _parse_json_flag(raw: str, flag: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        example = '{"key": 1}'
        problem = f"not valid JSON ({exc.msg} at column {exc.colno})"
        raise ConfigError(f"{flag} {raw!r}: {problem}; pass e.g. '{example}'") from None


class _ValueFlag(argparse.Action):
    """Stores a config flag's converted value and records which spelling was typed."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        flag = option_string or self.option_strings[0]
        setattr(namespace, self.dest, parse_flag_value(self.dest, values, flag))
        _record(namespace, self.dest, flag)


class _BoolFlag(argparse.BooleanOptionalAction):
    """`--x/--no-x` for a bool field, recording which spelling was typed."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _record(namespace, self.dest, option_string or self.option_strings[0])


class _ModelTag(argparse.Action):
    """The positional MODEL of serve/generate: sets model.model as `--model` would."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values is None or values is argparse.SUPPRESS:
            return
        setattr(namespace, "model.model", values)
        _record(namespace, "model.model", "--model")
