"""Example of a hooks plugin with a misspelled hook: `llmplug_request_evnt` matches no specification.

pluggy alone would register it and never call it. The registry refuses the whole module instead
(its correct `llmplug_stats` too, so it is never half-loaded) and reports the name it probably meant.
"""

from __future__ import annotations

from typing import Any

from llmplug.core.hookspecs import hookimpl

STATS: list[dict[str, Any]] = []


@hookimpl
def llmplug_request_evnt(event: str, request_id: str) -> None:
    """Misspelled on purpose (llmplug_request_event)."""


@hookimpl
def llmplug_stats(stats: dict[str, Any]) -> None:
    """Correct, but never registered because the module as a whole is refused."""
    STATS.append(stats)
