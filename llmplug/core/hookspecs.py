"""Hook specifications of `llmplug.hooks` plugins, grouped by the phase that calls them.

A hooks plugin is a module registered under the `llmplug.hooks` entry-point group whose functions are
decorated with `hookimpl` and named after a specification below:

    from llmplug.core.hookspecs import hookimpl

    @hookimpl
    def llmplug_request_event(event, request_id):
        ...

pluggy passes each implementation only the arguments it names, so an implementation may leave out
arguments it does not need, and new arguments can be added to a hook without breaking old plugins.
That is why hooks grow arguments rather than new hooks appear. Every allowed hooks module is
registered once per process by `PluginRegistry.hook_manager()`; callers use
`registry.hook_manager().hook.<name>(...)` with keyword arguments only.
No hook here is `firstresult`: every implementation is called, in reverse registration order,
and the caller receives the list of their non-None results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # no heavy imports at run time
    from llmplug.core.config import EngineConfig
    from llmplug.core.protocols import LogitsProcessor

PROJECT_NAME = "llmplug"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

REQUEST_EVENTS = ("added", "scheduled", "first_token", "finished", "aborted")

__all__ = [
    "PROJECT_NAME",
    "REQUEST_EVENTS",
    "hookimpl",
    "hookspec",
    "llmplug_adjust_config",
    "llmplug_logits_processors",
    "llmplug_request_event",
    "llmplug_stats",
]


# --- configuration phase (engine process, before anything is built) -------------------------------


@hookspec
def llmplug_adjust_config(config: dict[str, Any]) -> None:
    """Change the raw configuration before it is validated.

    Who calls it: the config loader, in the engine process, once per engine, after keyword
    arguments, the config file and CLI flags have been merged into one plain dict and BEFORE the
    pydantic `EngineConfig` is built from it.

    config: the merged dict, nested by section (`config["model"]["hf_overrides"]`, ...); sections
        that no source set may be missing. Modify it in place; the return value is ignored.
        Whatever is set here is validated like any other source, and errors name this hook.

    Not firstresult: every implementation runs, each seeing the previous ones' changes.
    """


# --- worker start (each worker process, once) --------------------------------------------------------


@hookspec
def llmplug_logits_processors(config: EngineConfig) -> list[LogitsProcessor]:
    """Return logits processors to apply to every request.

    Who calls it: each worker, once at engine start, after the model is loaded and before the first
    step. The returned processors run in the sampler for every request, after the request's own
    processors (guided decoding, penalties, bias), in the order the hook call returns them.

    config: the validated `EngineConfig` (read-only).
    Returns: a list (possibly empty) of objects implementing `llmplug.core.protocols.LogitsProcessor`.

    Not firstresult: the worker concatenates every implementation's list.
    """


# --- request lifecycle (engine process, per request) ------------------------------------------------


@hookspec
def llmplug_request_event(event: str, request_id: str, info: dict[str, Any]) -> None:
    """Observe a request's lifecycle.

    Who calls it: the engine core, in the engine process, synchronously in the step loop, so
    implementations must be fast and should not raise (an exception fails the step).

    event: one of REQUEST_EVENTS: "added" (accepted into the waiting queue), "scheduled" (first
        time it is given KV blocks and a token budget), "first_token" (first output token sampled),
        "finished" (stopped by length, stop token or stop string), "aborted" (cancelled by the
        client or on error).
    request_id: the request's id as the user gave it (or the engine made it).
    info: event details, e.g. {"num_prompt_tokens": ...} on "added", {"finish_reason": ...,
        "num_output_tokens": ...} on "finished". Keys may be added over time; read with .get().

    Not firstresult; return values are ignored.
    """


# --- engine step (engine process, per step) ----------------------------------------------------------


@hookspec
def llmplug_stats(stats: dict[str, Any]) -> None:
    """Receive the engine's counters after every step (stat loggers, metrics exporters).

    Who calls it: the engine core, in the engine process, after each step's outputs are processed.

    stats: a fresh dict per call with at least num_running, num_waiting (requests),
        kv_cache_usage (fraction of KV blocks in use, 0..1), prefix_cache_hit_rate (0..1 since
        start), num_generation_tokens and num_prompt_tokens (this step). Keys may be added over
        time; read with .get().

    Not firstresult; return values are ignored.
    """
