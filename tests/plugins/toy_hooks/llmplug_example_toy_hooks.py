"""Example hooks plugin: adjusts the raw config on request and records request events.

Registered as `llmplug.hooks` "toy". It acts on the config only when the config asks for it
(`model.hf_overrides` has a key "toy_hook"), so installing it changes nothing else.
"""

from __future__ import annotations

from typing import Any

from llmplug.core.hookspecs import hookimpl

LLMPLUG_PLUGIN_API_VERSION = "1.0"

EVENTS: list[tuple[str, str]] = []  # (event, request_id), in call order


@hookimpl
def llmplug_adjust_config(config: dict[str, Any]) -> None:
    """Set scheduler.max_num_seqs to the value of model.hf_overrides["toy_hook"], when present."""
    overrides = config.get("model", {}).get("hf_overrides", {})
    if "toy_hook" in overrides:
        config.setdefault("scheduler", {})["max_num_seqs"] = int(overrides["toy_hook"])


@hookimpl
def llmplug_request_event(event: str, request_id: str) -> None:
    """Record the event; takes only the arguments it needs (pluggy passes just those)."""
    EVENTS.append((event, request_id))
