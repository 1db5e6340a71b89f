"""Generate docs/config.md from the config schema: `python -m llmplug.core.config_docs > docs/config.md`."""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic.fields import FieldInfo

from llmplug.core.config import ALIASES, FIELD_FLAGS, SECTIONS, is_bool_field

_INTRO = """\
# Configuration reference

<!-- Generated from llmplug/core/config/schema.py by `python -m llmplug.core.config_docs > docs/config.md`;
     edit the schema, not this file (a test checks they agree). -->

One `EngineConfig` holds every engine setting, in sections: {sections}.

## Sources and precedence

A value can come from four places; a later one overrides an earlier one, field by field:

1. the schema's default;
2. keyword arguments (`load_config(kwargs=...)`, `LLM(**kwargs)`);
3. a config file (`--config FILE`, `LLM(config=FILE)`): YAML (`.yaml`, `.yml`), TOML (`.toml`) or JSON (`.json`);
4. CLI flags.

`llmplug.core.config.load_config(kwargs=, file=, cli=, apply_hooks=True, order=("kwargs", "file", "cli"))`
applies that order; `order` lists the sources lowest first, so a caller whose keyword arguments should
beat its file passes `order=("file", "kwargs", "cli")`. Dict fields (`model.hf_overrides`, `load.extra`,
`plugins.prefer`) are replaced as a whole, not merged. After merging, the `llmplug_adjust_config` hooks
of the allowed `llmplug.hooks` plugins may edit the merged dict (the `plugins` section is applied first,
so the allow-list decides whose hooks run: those of the registry this config builds, never the process's
or another engine's); then the whole config is validated once.
`llmplug config` prints the result with the source of every value.

## Keys

In keyword arguments and files a value can be given

- nested by section: `cache: {{block_size: 32}}` (a section may also be a section object in kwargs:
  `cache=CacheConfig(block_size=32)`, of which only the fields set explicitly count);
- by dotted key: `"cache.block_size": 32`;
- by a flat vLLM-style alias: `block_size: 32`, `gpu_memory_utilization: 0.8` (table below).

Giving one field twice in one source (`block_size` and `cache.block_size`) is an error. So is any key
that is not a section, a dotted field or an alias; the message suggests the closest valid key.

```yaml
# llmplug.yaml
model: /models/llama-3-8b        # the alias `model`, i.e. model.model
gpu_memory_utilization: 0.8       # alias of cache.memory_fraction
cache:
  block_size: 32
load:
  format: safetensors
device:
  platform: cuda
parallel:
  executor: multiproc
decoding:
  guided_backend: xgrammar
```

```toml
# llmplug.toml
[model]
model = "/models/llama-3-8b"

[cache]
block_size = 32
```

```json
{{"model": {{"model": "/models/llama-3-8b"}}, "cache.block_size": 32, "max_num_seqs": 64}}
```

## CLI flags

Every field has a flag: the field name with dashes (`--block-size`), or, where the bare name would be
ambiguous, the vLLM name (`--load-format`, `--distributed-executor-backend`) or `--<section>-<field>`
(`--plugins-enabled`). The vLLM alias flags work too (`--gpu-memory-utilization`). Booleans take
`--x` / `--no-x`; dict fields take JSON (`--hf-overrides '{{"rope_theta": 1e6}}'`); list fields take
commas (`--plugins-enabled my-dist,other-dist`); optional fields take `none` to unset.

## Errors

Every error is a `llmplug.core.errors.ConfigError` naming the field, the value and its source, e.g.

    cache.block_size = -3 (from file /etc/llmplug.yaml): Input should be greater than 0
    unknown config key 'blok_size' (from file /etc/llmplug.yaml); did you mean 'block_size' or 'cache.block_size'?

A file that does not parse names the file and, where the parser knows it, the line and column.
Sources are written `default`, `kwargs`, `file PATH`, `flag --name` and `hook llmplug_adjust_config`.
"""


def markdown() -> str:
    """The whole of docs/config.md."""
    parts = [_INTRO.format(sections=", ".join(f"`{s}`" for s in SECTIONS))]
    for section, cls in SECTIONS.items():
        parts.append(_section_table(section, cls))
    parts.append(_alias_table())
    return "\n".join(parts)


def _section_table(section: str, cls: Any) -> str:
    lines = [f"## `{section}`: {cls.__doc__}", "", "| field | type | default | flag | alias | meaning |"]
    lines.append("|---|---|---|---|---|---|")
    for name, field in cls.model_fields.items():
        path = f"{section}.{name}"
        default = f"`{_default_text(field)}`"
        flags, aliases = _flags_text(path), _aliases_text(path)
        cells = [f"`{path}`", _type_text(field), default, flags, aliases, field.description or ""]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _alias_table() -> str:
    lines = ["## Flat aliases", "", "| alias | field |", "|---|---|"]
    lines += [f"| `{alias}` | `{path}` |" for alias, path in ALIASES.items()]
    return "\n".join(lines) + "\n"


def _type_text(field: FieldInfo) -> str:
    text = _annotation_text(field.annotation)
    bounds = [f"{symbol} {getattr(item, attr)}" for item in field.metadata
              for attr, symbol in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")) if hasattr(item, attr)]
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _annotation_text(annotation: Any) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(f'"{arg}"' for arg in typing.get_args(annotation))
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default_text(field: FieldInfo) -> str:
    return json.dumps(field.get_default(call_default_factory=True))


def _flags_text(path: str) -> str:
    flags = list(FIELD_FLAGS[path])
    if is_bool_field(path):
        flags = [f"{flag}` / `--no-{flag[2:]}" for flag in flags]
    return ", ".join(f"`{flag}`" for flag in flags)


def _aliases_text(path: str) -> str:
    return ", ".join(f"`{alias}`" for alias, target in ALIASES.items() if target == path)


if __name__ == "__main__":
    print(markdown(), end="")
