"""Hardware platforms: the base class and choosing one (`resolve_platform`).

Exports `BasePlatform`, `PLATFORMS_GROUP`, `resolve_platform` and `detect_platforms`. The in-tree
platforms (cpu, cuda, rocm, tpu, xpu) are entry points of `llmplug.platforms`, found through the
plugin registry exactly like a third-party platform; nothing here imports them by module path.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from llmplug.core.errors import ConfigError, PluginError
from llmplug.core.protocols import Platform
from llmplug.platforms.base import BasePlatform

__all__ = ["BasePlatform", "PLATFORMS_GROUP", "detect_platforms", "resolve_platform"]

logger = logging.getLogger(__name__)

PLATFORMS_GROUP = "llmplug.platforms"
# what Platform asks of a class: its annotated attributes and its methods (Python 3.10 has no API for this)
_PROTOCOL_MEMBERS = tuple(Platform.__annotations__) + tuple(
    name for name, member in vars(Platform).items() if isinstance(member, classmethod)
)


def _registry(registry: Any | None) -> Any:
    """The given registry, else the process-wide one."""
    if registry is not None:
        return registry
    from llmplug.core.plugins import get_registry

    return get_registry()


def _load(registry: Any, name: str) -> type[BasePlatform]:
    """Load platform `name`, with BasePlatform's defaults under a class that implements only the protocol."""
    return _with_defaults(registry.load(PLATFORMS_GROUP, name), name)


@functools.cache
def _with_defaults(platform: Any, name: str) -> type[BasePlatform]:
    """`platform` itself if it derives from BasePlatform; else a subclass adding BasePlatform's defaults.

    The Platform protocol is what a plugin must implement; the capability queries the engine also
    asks (device, visible_device_index, preferred_dtype, ...) are optional and default to BasePlatform's.
    """
    if isinstance(platform, type) and issubclass(platform, BasePlatform):
        return platform
    if not (isinstance(platform, type) and isinstance(platform, Platform)):
        missing = [member for member in _PROTOCOL_MEMBERS if not hasattr(platform, member)]
        raise PluginError(
            f"the {PLATFORMS_GROUP} entry point {name!r} is {platform!r}, which does not implement "
            f"llmplug.core.protocols.Platform (missing: {', '.join(missing) or 'it is not a class'}). "
            f"Point the entry point at a class that implements it (simplest: derive from "
            f"llmplug.platforms.BasePlatform)."
        )
    # the plugin's own members come first in the MRO; BasePlatform only fills what it leaves out
    namespace = {"__module__": platform.__module__, "__doc__": platform.__doc__}
    return type(platform.__name__, (platform, BasePlatform), namespace)


def _reason(platform: type[BasePlatform]) -> str | None:
    """Why `platform` is unusable here, or None; a platform whose detection raises is unusable, with the error."""
    try:
        if platform.is_available():
            return None
        return platform.unavailable_reason() or "is_available() returned False"
    except Exception as error:  # a third-party platform's detection bug must not stop the others
        logger.warning("platform %r: detection failed: %s: %s", platform.name, type(error).__name__, error)
        return f"detection failed: {type(error).__name__}: {error}"


def _try_load(registry: Any, name: str) -> tuple[type[BasePlatform] | None, str | None]:
    """(platform, None), or (None, why it could not be loaded), logging load failures as warnings."""
    try:
        return _load(registry, name), None
    except PluginError as error:
        logger.warning("platform %r skipped: %s", name, error)
        return None, f"could not be loaded: {error}"


def detect_platforms(registry: Any | None = None) -> dict[str, str | None]:
    """Every registered platform's name -> None when usable here, else what was detected instead."""
    registry = _registry(registry)
    report: dict[str, str | None] = {}
    for name in registry.names(PLATFORMS_GROUP):
        platform, load_failure = _try_load(registry, name)
        report[name] = load_failure if platform is None else _reason(platform)
    return report


def _describe(report: dict[str, str | None]) -> str:
    """'cpu: available; cuda: torch ... built without CUDA; ...' for error messages."""
    return "; ".join(f"{name}: {reason or 'available'}" for name, reason in report.items())


def _auto(registry: Any) -> type[BasePlatform]:
    """The available platform with the highest priority (ties: first by name)."""
    available = []
    for name in registry.names(PLATFORMS_GROUP):  # sorted, so ties resolve the same way everywhere
        platform, _ = _try_load(registry, name)
        if platform is not None and _reason(platform) is None:
            available.append(platform)
    if not available:
        raise ConfigError(
            f"device.platform='auto' found no usable platform. Detected: {_describe(detect_platforms(registry))}. "
            f"Install the software of one of them, or allow the cpu platform in plugins.enabled."
        )
    chosen = max(available, key=lambda platform: platform.priority)
    logger.info("platform auto: chose %r among %s", chosen.name, [platform.name for platform in available])
    return chosen


def _named(registry: Any, name: str) -> type[BasePlatform]:
    """Platform `name`, or a ConfigError saying what this machine has instead."""
    from llmplug.core.plugins import PluginNotFoundError

    try:
        platform = _load(registry, name)
    except PluginNotFoundError as error:
        raise ConfigError(f"device.platform={name!r} is not a registered platform: {error}") from error
    reason = _reason(platform)
    if reason is None:
        return platform
    others = {other: why for other, why in detect_platforms(registry).items() if other != name}
    usable = [other for other, why in others.items() if why is None]
    raise ConfigError(
        f"device.platform={name!r} is not available here: {reason}. Other platforms: {_describe(others)}. "
        f"Set device.platform to 'auto' or one of: {', '.join(usable) or 'none'}."
    )


def resolve_platform(name: str = "auto", registry: Any | None = None) -> type[BasePlatform]:
    """The platform class for `device.platform`: by name, or for "auto" the available one with the highest priority.

    `registry` is a `llmplug.core.plugins.PluginRegistry` (default: the process-wide one).
    """
    registry = _registry(registry)
    return _auto(registry) if name == "auto" else _named(registry, name)
