"""The output of `llmplug config`: a resolved config as YAML (each value's source as a comment), JSON or a table."""

from __future__ import annotations

import json
from typing import Any

from llmplug.core.config.loading import ResolvedConfig
from llmplug.core.errors import ConfigError

CONFIG_FORMATS = ("yaml", "json", "table")


def format_config(resolved: ResolvedConfig, fmt: str = "yaml") -> str:
    """Render a resolved config: YAML with each value's source as a comment (loadable again), JSON or a table."""
    values = resolved.config.model_dump(mode="json")
    if fmt == "yaml":
        return _format_yaml(values, resolved.sources)
    if fmt == "json":
        return json.dumps({"config": values, "sources": resolved.sources}, indent=2)
    if fmt == "table":
        return _format_table(values, resolved.sources)
    raise ConfigError(f"unknown config output format {fmt!r}; use one of {', '.join(CONFIG_FORMATS)}")


def _format_yaml(values: dict[str, dict[str, Any]], sources: dict[str, str]) -> str:
    lines = [
        "# llmplug engine config; the comment after each value says where it came from.",
        "# Load it again with --config FILE.",
    ]
    for section, fields in values.items():
        lines.append(f"{section}:")
        lines += [f"  {name}: {_yaml_value(value)}  # {sources[f'{section}.{name}']}" for name, value in fields.items()]
    return "\n".join(lines) + "\n"


def _yaml_value(value: Any) -> str:
    """One value as single-line YAML (flow style for dicts and lists)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True)
    return text.removesuffix("\n...\n").strip()


def _format_table(values: dict[str, dict[str, Any]], sources: dict[str, str]) -> str:
    rows = [("field", "value", "source")]
    for section, fields in values.items():
        rows += [(f"{section}.{name}", json.dumps(v), sources[f"{section}.{name}"]) for name, v in fields.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows) + "\n"
