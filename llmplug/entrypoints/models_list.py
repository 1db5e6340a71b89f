"""`llmplug models`: every architecture of the `llmplug.models` group, its family, its kind (generate, or
pooling: embeddings and classifiers), which implementation runs it and what it supports; with
`--transformers`, also every causal LM transformers has that no native plugin implements, run by the
transformers backend (or why not).

Kept light at import time (the CLI builds every parser on each call): the model classes are imported
inside `run`, one module per family. A class that fails to import is listed with the reason.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

FEATURES = ("tp", "pp", "gguf", "int4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--json: one JSON list of rows instead of a table; --transformers: add the backend's architectures."""
    parser.add_argument("--json", action="store_true", help="One JSON list of rows instead of a table.")
    parser.add_argument(
        "--transformers", action="store_true",
        help="Also list transformers' causal LMs without a native plugin, run by the transformers backend "
        "(imports every transformers model class: slow).",
    )


def run(args: argparse.Namespace) -> int:
    """Print one row per registered architecture (and per backend architecture with --transformers)."""
    rows = model_rows(transformers_types=() if args.transformers else None)
    print(json.dumps(rows, indent=2) if args.json else _table(rows))
    return 0


def model_rows(transformers_types: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """{architecture, family, kind, impl, distribution, tp, pp, gguf, int4, error} per name of `llmplug.models`
    (sorted, impl "native"), then, unless `transformers_types` is None, per transformers causal LM of those model
    types (empty: all) without a native plugin (impl "transformers", or "-" with the reason the backend cannot
    run it as error)."""
    from llmplug.core.errors import PluginError
    from llmplug.core.plugins import get_registry
    from llmplug.loaders.base import TRANSFORMERS_BACKEND
    from llmplug.loaders.gguf_config import ARCHITECTURES as GGUF_ARCHITECTURES

    registry, gguf = get_registry(), {row.hf_architecture for row in GGUF_ARCHITECTURES.values()}
    rows = []
    for info in sorted(registry.infos("llmplug.models"), key=lambda i: i.name):
        row: dict[str, Any] = {"architecture": info.name, "distribution": info.distribution, "error": ""}
        try:
            cls = registry.load("llmplug.models", info.name)
        except PluginError as error:
            rows.append(row | {"family": "-", "kind": "-", "impl": "native", **dict.fromkeys(FEATURES, False),
                               "error": str(error)})
            continue
        rows.append(row | _features(cls, info.name in gguf))
    if transformers_types is not None:
        backend = registry.load("llmplug.models", TRANSFORMERS_BACKEND)
        native = {row["architecture"] for row in rows}
        found = backend.architectures(transformers_types or None)
        rows += [_backend_row(name, *found[name]) for name in sorted(found) if name not in native]
    return rows


def _features(cls: type, gguf: bool) -> dict[str, Any]:
    """A model class's family (its own `family`, else its module's name) and feature flags."""
    return {
        "family": getattr(cls, "family", None) or cls.__module__.rsplit(".", 1)[-1],
        "kind": "pooling" if getattr(cls, "is_pooling_model", False) else "generate",
        "impl": "native",
        "tp": bool(getattr(cls, "supports_tensor_parallel", False)),
        "pp": bool(getattr(cls, "supports_pipeline_parallel", False)),
        "gguf": gguf,
        "int4": bool(getattr(cls, "supports_int4", False)),
    }


def _backend_row(architecture: str, why: str | None, tp_plan: bool) -> dict[str, Any]:
    """A transformers causal LM run by the backend (tensor parallelism through its config's plan); impl "-" and
    the reason when the backend cannot run it."""
    return {"architecture": architecture, "family": "transformers", "kind": "generate",
            "impl": "transformers" if why is None else "-",
            "tp": why is None and tp_plan, "pp": False, "gguf": False, "int4": False, "distribution": "transformers",
            "error": why or ""}


def _table(rows: list[dict[str, Any]]) -> str:
    """Aligned columns; a row's error (why it cannot be loaded or run) follows its last column."""
    header = ("ARCHITECTURE", "FAMILY", "KIND", "IMPL", *(f.upper() for f in FEATURES), "DISTRIBUTION")
    cells = [header] + [
        (r["architecture"], r["family"], r["kind"], r["impl"], *("yes" if r[f] else "-" for f in FEATURES),
         r["distribution"])
        for r in rows
    ]
    errors = [""] + [f"  error: {r['error']}" if r["error"] else "" for r in rows]
    widths = [max(len(str(c[i])) for c in cells) for i in range(len(header))]
    lines = ("  ".join(f"{str(c):<{w}}" for c, w in zip(cell, widths)) + error for cell, error in zip(cells, errors))
    return "\n".join(line.rstrip() for line in lines)
