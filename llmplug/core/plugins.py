"""The plugin registry: entry-point groups, lazy discovery, allow-list, conflicts, API versions.

Named groups ("drivers": platforms, loaders, models, ...) are resolved by name and the chosen entry
point is loaded with stevedore; the modules of `llmplug.hooks` are all registered together in one
pluggy PluginManager. Listing reads distribution metadata only and imports no plugin module;
`load` imports only the plugin asked for.

Each engine owns the registry built from its config (`PluginRegistry.from_config`) and passes it
explicitly to what it builds (executor, workers, loaders, guided decoding, platform choice); worker
processes get a pickled copy, which carries the allow-list as the engine resolved it, so it means the
same in every process. Two engines in one process share no plugin state. The process-wide registry
(`get_registry`) serves what runs outside an engine: `llmplug plugins`, standalone helpers.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
import threading
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from llmplug.core.errors import PluginConflictError, PluginError, PluginLoadError, PluginVersionError
from llmplug.core.protocols import PLUGIN_API_VERSION

if TYPE_CHECKING:  # listing plugins must stay cheap: pluggy/stevedore load only when needed
    import pluggy

    from llmplug.core.config import PluginConfig

log = logging.getLogger("llmplug.plugins")

BUILTIN_DISTRIBUTION = "llmplug"
HOOKS_GROUP = "llmplug.hooks"
ENABLED_ENV = "LLMPLUG_PLUGINS"
API_VERSION_ATTR = "LLMPLUG_PLUGIN_API_VERSION"

GROUPS: dict[str, str] = {
    "llmplug.platforms": "hardware platform: device.platform name -> Platform class",
    "llmplug.loaders": "weight format: load.format name -> ModelLoader class",
    "llmplug.models": "model architecture: HF architecture name -> model class",
    "llmplug.guided_decoding": "structured output: decoding.guided_backend name -> backend class",
    "llmplug.executors": "worker executor: parallel.executor name -> executor class",
    "llmplug.attention": "attention backend: device.attention_backend name -> backend class",
    "llmplug.communicators": "device collectives: Platform.get_communicator() name -> communicator class",
    "llmplug.tool_parsers": "tool calls in model output: serve --tool-call-parser name -> ToolParser class",
    "llmplug.reasoning_parsers": "reasoning in model output: serve --reasoning-parser name -> ReasoningParser class",
    "llmplug.lora_resolvers": "where LoRA adapters come from: serve --lora-resolver name -> LoRAResolver class",
    "llmplug.quantization": "quantized checkpoints: config.json quant_method (or quantization) -> QuantizationConfig class",
    "llmplug.kv_connectors": "KV block transfer: kv_transfer_config.kv_connector name -> KVConnector class",
    HOOKS_GROUP: "general plugins: name -> module of pluggy hookimpls, all registered together",
}
NAMED_GROUPS: tuple[str, ...] = tuple(group for group in GROUPS if group != HOOKS_GROUP)

__all__ = [
    "GROUPS",
    "NAMED_GROUPS",
    "PluginInfo",
    "PluginNotFoundError",
    "PluginRegistry",
    "check_api_version",
    "enabled_from_env",
    "get_registry",
    "load_plugin",
    "set_registry",
]


class PluginNotFoundError(PluginError, KeyError):
    """No allowed plugin has the requested name in a group; the message lists the available names."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; users should read the message itself.
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class PluginInfo:
    """One entry point of one installed distribution, read from metadata (nothing imported)."""

    group: str
    name: str
    value: str  # "module:attr", without extras
    distribution: str
    version: str
    builtin: bool  # registered by llmplug's own distribution
    extras: tuple[str, ...] = ()  # from "module:attr [extra1,extra2]"

    @property
    def key(self) -> str:
        """'group:name', the form that plugins.prefer and plugins.enabled use."""
        return f"{self.group}:{self.name}"

    @property
    def module(self) -> str:
        """The module the entry point imports."""
        return self.value.partition(":")[0]

    def origin(self) -> str:
        """Who this is, for messages: group, name, distribution, version and target."""
        return f"{self.group} plugin {self.name!r} from distribution {self.distribution} {self.version} ({self.value})"


# --- discovery (metadata only) -------------------------------------------------------------------------


def _normalize(name: str) -> str:
    """PEP 503 form of a distribution name, so 'llmplug_example-x' and 'llmplug-example-x' match."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _info(entry_point: importlib.metadata.EntryPoint, distribution: str, version: str) -> PluginInfo:
    """The PluginInfo of one entry point of `distribution`."""
    value = f"{entry_point.module}:{entry_point.attr}" if entry_point.attr else entry_point.module
    return PluginInfo(
        group=entry_point.group,
        name=entry_point.name,
        value=value,
        distribution=distribution,
        version=version,
        builtin=_normalize(distribution) == BUILTIN_DISTRIBUTION,
        extras=tuple(entry_point.extras),
    )


def _scan() -> dict[PluginInfo, importlib.metadata.EntryPoint]:
    """Every llmplug entry point of every distribution on sys.path, as installed now.

    Reading every distribution's metadata takes ~0.5 s on 2 cores, and each engine builds its registry (twice
    when it starts); so the last reading is kept while sys.path and the modification time of each of its
    directories are unchanged (installing or removing a distribution adds or removes an entry there)."""
    # Read from metadata instead of stevedore's entry-point cache: that cache drops the distribution of each
    # entry point (needed for conflicts and the allow-list) and stevedore keeps it class-wide per process, so a
    # plugin pip-installed after the first lookup would stay invisible.
    state = _sys_path_state()
    with _SCAN_LOCK:
        if _last_scan.get("state") != state:
            _last_scan.update(state=state, found=_read_entry_points())
        return dict(_last_scan["found"])


_SCAN_LOCK = threading.Lock()
_last_scan: dict[str, Any] = {}  # "state": the sys.path state it was read in, "found": what _scan answers


def _sys_path_state() -> tuple[tuple[str, int], ...]:
    """Each sys.path entry with its modification time (ns; -1 where it cannot be read)."""
    state = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, -1))
    return tuple(state)


def _read_entry_points() -> dict[PluginInfo, importlib.metadata.EntryPoint]:
    """Every llmplug entry point of every distribution on sys.path, read from metadata."""
    importlib.invalidate_caches()
    found: dict[PluginInfo, importlib.metadata.EntryPoint] = {}
    seen: set[str] = set()
    for dist in importlib.metadata.distributions():
        entry_points = [ep for ep in dist.entry_points if ep.group in GROUPS]
        if not entry_points:
            continue
        distribution = dist.metadata["Name"]
        if _normalize(distribution) in seen:  # shadowed by an earlier sys.path entry, as imports are
            continue
        seen.add(_normalize(distribution))
        for entry_point in entry_points:
            found[_info(entry_point, distribution, dist.version)] = entry_point
    return found


def _check_group(group: str) -> None:
    """Refuse a group that llmplug does not define."""
    if group not in GROUPS:
        hint = difflib.get_close_matches(group, GROUPS, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        raise PluginError(f"unknown plugin group {group!r}.{did_you_mean} The groups are: {', '.join(GROUPS)}.")


def _split_key(key: str, where: str) -> tuple[str, str]:
    """'group:name' -> (group, name), refusing malformed keys of `where` (a config field)."""
    group, sep, name = key.partition(":")
    if not sep or not name or group not in GROUPS:
        raise PluginError(
            f"{where} has the key {key!r}; keys must be 'group:name' with a group among {', '.join(GROUPS)}, "
            f"e.g. 'llmplug.loaders:fancy'."
        )
    return group, name


def enabled_from_env() -> list[str] | None:
    """The allow-list from LLMPLUG_PLUGINS (comma separated); None when unset or blank (all allowed)."""
    raw = os.environ.get(ENABLED_ENV, "")
    entries = [entry.strip() for entry in raw.split(",") if entry.strip()]
    return entries or None


# --- loading ---------------------------------------------------------------------------------------------


@functools.cache
def _driver_class() -> type:
    """A stevedore DriverManager that loads the one entry point the registry already chose."""
    from stevedore.driver import DriverManager  # imported on first load only: listing stays cheap

    class ChosenDriver(DriverManager):
        """Loads `entry_point` only; stevedore's own lookup by name cannot tell distributions apart."""

        def __init__(self, entry_point: importlib.metadata.EntryPoint, on_failure: Any) -> None:
            self._chosen = entry_point
            super().__init__(
                entry_point.group,
                entry_point.name,
                on_load_failure_callback=on_failure,
                on_missing_entrypoints_callback=None,
            )

        def list_entry_points(self) -> list[importlib.metadata.EntryPoint]:
            return [self._chosen]

    return ChosenDriver


def _import_plugin(info: PluginInfo, entry_point: importlib.metadata.EntryPoint) -> object:
    """Import the object `info` names; any failure becomes a PluginLoadError chained to its cause."""

    def fail(_manager: Any, _entry_point: Any, error: BaseException) -> None:
        cause = f"{type(error).__name__}: {error}"
        raise PluginLoadError(f"{info.origin()} failed to load: {cause}. {_load_fix(info)}") from error

    return _driver_class()(entry_point, fail).driver


def _load_fix(info: PluginInfo) -> str:
    """What a user can do about a plugin that fails to import."""
    if info.builtin:
        return "It is in-tree: install the optional requirements of that backend (llmplug's extras) or choose another."
    return (
        f"Install what it needs (pip install {info.distribution} pulls its requirements), upgrade or uninstall "
        f"{info.distribution}, or leave it out of plugins.enabled / {ENABLED_ENV}."
    )


def _parse_api_version(declared: object, info: PluginInfo) -> tuple[int, int]:
    """'X.Y' -> (X, Y), refusing anything else with a message naming the plugin."""
    match = re.fullmatch(r"(\d+)\.(\d+)", str(declared).strip())
    if match is None:
        raise PluginVersionError(
            f"{info.origin()} declares {API_VERSION_ATTR} = {declared!r}; it must be 'MAJOR.MINOR' "
            f"such as {PLUGIN_API_VERSION!r}. Fix the plugin's declaration."
        )
    return int(match[1]), int(match[2])


def _declared_api_version(obj: object) -> object | None:
    """The API version declared on `obj`, or else on the module that defines it; None if neither."""
    declared = getattr(obj, API_VERSION_ATTR, None)
    if declared is not None or isinstance(obj, types.ModuleType):
        return declared
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    return getattr(module, API_VERSION_ATTR, None)


def check_api_version(obj: object, info: PluginInfo) -> None:
    """Refuse a loaded plugin whose declared API major differs from ours or whose minor is newer."""
    declared = _declared_api_version(obj)
    if declared is None:  # undeclared: assume it targets the current API
        return
    theirs = _parse_api_version(declared, info)
    ours = _parse_api_version(PLUGIN_API_VERSION, info)
    if theirs[0] != ours[0] or theirs[1] > ours[1]:
        raise PluginVersionError(
            f"plugin {info.key!r} from distribution {info.distribution} {info.version} targets plugin API "
            f"{declared}, but this llmplug provides plugin API {PLUGIN_API_VERSION} and accepts plugins built "
            f"for {ours[0]}.x up to {PLUGIN_API_VERSION}. Install a release of {info.distribution} built for "
            f"plugin API {ours[0]}.x, or an llmplug that provides {declared}."
        )


# --- usability without importing ----------------------------------------------------------------------------


def _child_locations(locations: Iterable[str], part: str) -> list[str] | None:
    """Search paths of submodule `part` in `locations`: [dir] for a package, [] for a module, None if absent."""
    for location in locations:
        package_dir = os.path.join(location, part)
        if os.path.isdir(package_dir):
            return [package_dir]
        if any(os.path.isfile(package_dir + suffix) for suffix in importlib.machinery.all_suffixes()):
            return []
    return None


def _missing_module(module: str) -> str | None:
    """Why `module` cannot be imported, found from the file system alone; None if it looks importable."""
    top, *parts = module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level lookup imports nothing
    except (ImportError, ValueError) as error:
        return f"module {top!r} cannot be located: {error}"
    if spec is None:
        return f"module {top!r} is not installed"
    locations = list(spec.submodule_search_locations or [])
    if not all(os.path.isdir(location) for location in locations):
        return None  # zip or custom finder: cannot tell without importing
    for depth, part in enumerate(parts, start=1):
        found = _child_locations(locations, part)
        if found is None:
            return f"module {'.'.join([top, *parts[:depth]])!r} does not exist"
        locations = found
    return None


def _requirement_problem(requirement_text: str, extra: str) -> str | None:
    """Why a requirement needed by `extra` is unmet; None when met or not specific to that extra."""
    from packaging.requirements import Requirement  # only when some entry point declares extras

    requirement = Requirement(requirement_text)
    marker = requirement.marker
    # Only requirements that the extra adds: true with the extra, false without it.
    if marker is None or not marker.evaluate({"extra": extra}) or marker.evaluate({"extra": ""}):
        return None
    try:
        installed = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return f"extra [{extra}] needs {requirement.name}{requirement.specifier}, which is not installed"
    if requirement.specifier and not requirement.specifier.contains(installed, prereleases=True):
        return f"extra [{extra}] needs {requirement.name}{requirement.specifier}, found {installed}"
    return None


def _missing_extras(entry_point: importlib.metadata.EntryPoint, extras: tuple[str, ...]) -> str | None:
    """Why the requirements of the entry point's extras are unmet; None when they are met."""
    requirements = (entry_point.dist.requires if entry_point.dist else None) or []
    for extra in extras:
        for requirement_text in requirements:
            problem = _requirement_problem(requirement_text, extra)
            if problem is not None:
                return f"{problem} (pip install '{entry_point.dist.metadata['Name']}[{extra}]')"
    return None


# --- the registry -------------------------------------------------------------------------------------------


class PluginRegistry:
    """The plugins one process may use: listing, choosing by name, loading, and the hook manager."""

    def __init__(self, enabled: list[str] | None = None, prefer: dict[str, str] | None = None) -> None:
        self.enabled = list(enabled) if enabled is not None else None
        self.prefer = dict(prefer or {})
        for key in self.prefer:
            _split_key(key, "plugins.prefer")
        self.errors: list[PluginError] = []  # hooks modules that could not be registered
        self._enabled_dists = {_normalize(e) for e in self.enabled or [] if ":" not in e}
        self._enabled_keys = {e for e in self.enabled or [] if ":" in e}
        self._lock = threading.RLock()
        self._entry_points: dict[PluginInfo, importlib.metadata.EntryPoint] | None = None
        self._loaded: dict[PluginInfo, object] = {}
        self._hook_manager: pluggy.PluginManager | None = None

    @classmethod
    def from_config(cls, plugin_config: PluginConfig) -> PluginRegistry:
        """The registry of a `PluginConfig`; LLMPLUG_PLUGINS applies when its `enabled` is None."""
        enabled = plugin_config.enabled if plugin_config.enabled is not None else enabled_from_env()
        return cls(enabled=enabled, prefer=dict(plugin_config.prefer))

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        # A worker gets the same allow-list (as resolved here, LLMPLUG_PLUGINS included) and preferences
        # and rediscovers on its own.
        return (type(self), (self.enabled, self.prefer))

    def __repr__(self) -> str:
        return f"PluginRegistry(enabled={self.enabled!r}, prefer={self.prefer!r})"

    def refresh(self) -> None:
        """Forget discovered entry points so distributions installed since are seen; loaded objects stay."""
        with self._lock:
            self._entry_points = None

    # listing ----------------------------------------------------------------------------------------

    def infos(self, group: str) -> list[PluginInfo]:
        """Allowed entry points of `group`, conflicting ones included, sorted by name and distribution."""
        _check_group(group)
        allowed = (info for info in self._discovered() if info.group == group and self.is_allowed(info))
        return sorted(allowed, key=lambda info: (info.name, _normalize(info.distribution)))

    def names(self, group: str) -> list[str]:
        """Sorted distinct names of the allowed entry points of `group`."""
        return sorted({info.name for info in self.infos(group)})

    def is_allowed(self, info: PluginInfo) -> bool:
        """In-tree plugins always; third-party ones when the allow-list is unset or names them."""
        if info.builtin or self.enabled is None:
            return True
        return _normalize(info.distribution) in self._enabled_dists or info.key in self._enabled_keys

    # choosing and loading -------------------------------------------------------------------------------

    def resolve(self, group: str, name: str) -> PluginInfo:
        """The one entry point that `name` means in `group`, after allow-list and plugins.prefer."""
        candidates = [info for info in self.infos(group) if info.name == name]
        if not candidates:
            raise self._not_found(group, name)
        preferred = self.prefer.get(f"{group}:{name}")
        if preferred is not None:
            return _pick_preferred(candidates, preferred)
        if len(candidates) > 1:
            raise _conflict(candidates)
        return candidates[0]

    def load(self, group: str, name: str) -> object:
        """Import and return the object registered as `name` in `group`; imports nothing else."""
        with self._lock:
            info = self.resolve(group, name)
            if info not in self._loaded:
                obj = _import_plugin(info, self._discovered()[info])
                check_api_version(obj, info)
                self._loaded[info] = obj
            return self._loaded[info]

    # hooks ------------------------------------------------------------------------------------------------

    def hook_manager(self) -> pluggy.PluginManager:
        """The pluggy manager with llmplug's hookspecs and every allowed hooks module (built once)."""
        with self._lock:
            if self._hook_manager is None:
                self._hook_manager = self._build_hook_manager()
            return self._hook_manager

    def _build_hook_manager(self) -> pluggy.PluginManager:
        import pluggy

        from llmplug.core import hookspecs

        manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        manager.add_hookspecs(hookspecs)
        for info in self.infos(HOOKS_GROUP):
            try:
                self._register_hooks(manager, info)
            except PluginError as error:  # one bad plugin never takes down the others
                self.errors.append(error)
                log.warning("%s", error)
        return manager

    def _register_hooks(self, manager: pluggy.PluginManager, info: PluginInfo) -> None:
        """Import one hooks module, check its API version and hooks, and register it whole or not at all."""
        import pluggy

        module = _import_plugin(info, self._discovered()[info])
        check_api_version(module, info)
        try:
            manager.register(module, name=f"{info.distribution}:{info.name}")
        except (pluggy.PluginValidationError, ValueError) as error:
            raise PluginLoadError(
                f"{info.origin()} cannot be registered: {error}. Make its hookimpls take only arguments "
                f"that llmplug.core.hookspecs defines."
            ) from error
        _refuse_unknown_hooks(manager, module, info)

    # the `llmplug plugins` listing -----------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """One row per installed entry point (allowed or not) for `llmplug plugins`; imports nothing."""
        group_order = list(GROUPS)
        ordered = sorted(self._discovered(), key=lambda i: (group_order.index(i.group), i.name, i.distribution))
        rows = []
        for info in ordered:
            reason = self._unusable_reason(info)
            rows.append(
                {
                    "group": info.group,
                    "name": info.name,
                    "distribution": info.distribution,
                    "version": info.version,
                    "usable": reason is None,
                    "reason": reason or "",
                }
            )
        return rows

    def _unusable_reason(self, info: PluginInfo) -> str | None:
        """Why `info` cannot be used here, decided from metadata and the file system only."""
        if not self.is_allowed(info):
            return f"not allowed: add {info.distribution!r} (or {info.key!r}) to plugins.enabled or {ENABLED_ENV}"
        if info.group != HOOKS_GROUP:
            reason = self._choice_reason(info)
            if reason is not None:
                return reason
        entry_point = self._discovered()[info]
        return _missing_module(info.module) or _missing_extras(entry_point, info.extras)

    def _choice_reason(self, info: PluginInfo) -> str | None:
        """Why `info` is not what its name resolves to (conflict, or another distribution preferred)."""
        try:
            chosen = self.resolve(info.group, info.name)
        except PluginConflictError:
            others = [i.distribution for i in self.infos(info.group) if i.name == info.name and i != info]
            return (
                f"conflict: also registered by {', '.join(others)}; choose with "
                f'plugins.prefer: {{"{info.key}": "<distribution>"}}'
            )
        except PluginNotFoundError as error:  # plugins.prefer names a distribution that lacks it
            return str(error)
        if chosen != info:
            return f"not chosen: plugins.prefer picks {chosen.distribution} for {info.key}"
        return None

    # internals ---------------------------------------------------------------------------------------------

    def _discovered(self) -> dict[PluginInfo, importlib.metadata.EntryPoint]:
        with self._lock:
            if self._entry_points is None:
                self._entry_points = _scan()
                self._warn_unmatched_enabled(self._entry_points)
            return self._entry_points

    def _warn_unmatched_enabled(self, infos: Iterable[PluginInfo]) -> None:
        """Log allow-list entries that match no installed plugin: usually a typo."""
        third_party = [info for info in infos if not info.builtin]
        dists = {_normalize(info.distribution) for info in third_party}
        keys = {info.key for info in third_party}
        for entry in self.enabled or []:
            if entry not in keys and _normalize(entry) not in dists:
                log.warning(
                    "plugins.enabled / %s entry %r matches no installed plugin distribution or 'group:name'; "
                    "installed third-party plugin distributions: %s",
                    ENABLED_ENV,
                    entry,
                    ", ".join(sorted(dists)) or "none",
                )

    def _not_found(self, group: str, name: str) -> PluginNotFoundError:
        """The error for an unknown name: what exists, what was meant, and what is installed but not allowed."""
        available = self.names(group)
        hint = difflib.get_close_matches(name, available, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        hidden = sorted(
            {i.distribution for i in self._discovered() if i.key == f"{group}:{name}" and not self.is_allowed(i)}
        )
        if hidden:
            fix = (
                f"Registered by distributions that are not allowed: {', '.join(hidden)}; "
                f"add the one you want to plugins.enabled or {ENABLED_ENV}."
            )
        else:
            fix = f"Install a distribution that registers it under the entry-point group {group!r}, or fix the name."
        return PluginNotFoundError(
            f"no {group} plugin named {name!r}.{did_you_mean} Available: {', '.join(available) or 'none'}. {fix}"
        )


def _pick_preferred(candidates: list[PluginInfo], preferred: str) -> PluginInfo:
    """The candidate from the distribution plugins.prefer names."""
    for info in candidates:
        if _normalize(info.distribution) == _normalize(preferred):
            return info
    key = candidates[0].key
    claimants = ", ".join(info.distribution for info in candidates)
    raise PluginNotFoundError(
        f"plugins.prefer picks distribution {preferred!r} for {key!r}, but among allowed plugins it is "
        f"registered only by {claimants}. Set plugins.prefer[{key!r}] to one of them, or install/enable {preferred!r}."
    )


def _conflict(candidates: list[PluginInfo]) -> PluginConflictError:
    """The error for one name claimed by several distributions, saying how to choose."""
    key = candidates[0].key
    claimants = "; ".join(f"{info.distribution} {info.version} ({info.value})" for info in candidates)
    return PluginConflictError(
        f"{key!r} is registered by {len(candidates)} distributions: {claimants}. Choose one in the config, "
        f'e.g. plugins.prefer: {{"{key}": "{candidates[0].distribution}"}}, or uninstall the others or leave '
        f"them out of plugins.enabled / {ENABLED_ENV}."
    )


def _refuse_unknown_hooks(manager: pluggy.PluginManager, module: object, info: PluginInfo) -> None:
    """Unregister `module` and raise if it implements a hook llmplug does not specify (likely a typo)."""
    from llmplug.core import hookspecs

    unknown = [
        caller.name
        for caller in manager.get_hookcallers(module) or []
        if not caller.has_spec()
        and any(impl.plugin is module and not impl.optionalhook for impl in caller.get_hookimpls())
    ]
    if not unknown:
        return
    manager.unregister(module)
    specified = [name for name in hookspecs.__all__ if name.startswith("llmplug_")]
    hints = {name: difflib.get_close_matches(name, specified, n=1) for name in unknown}
    meant = ", ".join(f"{name} (did you mean {hint[0]}?)" if hint else name for name, hint in hints.items())
    raise PluginLoadError(
        f"{info.origin()} implements hooks that llmplug does not specify: {meant}. Rename them to hooks "
        f"of llmplug.core.hookspecs, or mark them @hookimpl(optionalhook=True)."
    )


# --- the process-wide registry ---------------------------------------------------------------------------

_registry: PluginRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> PluginRegistry:
    """The registry of this process; built from LLMPLUG_PLUGINS on first use unless one was set."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = PluginRegistry(enabled=enabled_from_env())
        return _registry


def set_registry(registry: PluginRegistry) -> None:
    """Replace the process-wide registry (what `get_registry` and `load_plugin` use; engines have their own)."""
    global _registry
    with _registry_lock:
        _registry = registry


def load_plugin(group: str, name: str) -> object:
    """Load `name` from `group` through the process-wide registry."""
    return get_registry().load(group, name)
