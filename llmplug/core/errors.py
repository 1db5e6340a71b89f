"""The error types users of llmplug catch."""

from __future__ import annotations


class LlmplugError(Exception):
    """Base class of every error llmplug raises on purpose."""


class ConfigError(LlmplugError, ValueError):
    """A configuration value is invalid; the message names the field, value and source."""


class PluginError(LlmplugError):
    """A plugin could not be discovered, chosen or loaded."""


class PluginLoadError(PluginError):
    """A plugin's module failed to import; names distribution, group, name and the cause."""


class PluginConflictError(PluginError):
    """Two distributions register the same name in one group and the config picks neither."""


class PluginVersionError(PluginError):
    """A plugin targets an incompatible plugin API version."""


class InvalidRequestError(LlmplugError, ValueError):
    """A request (prompt or sampling parameters) is invalid; only that request fails.

    `param` names the offending request field when there is one (the server's error body reports it).
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(LlmplugError, RuntimeError):
    """A failure inside an engine step ended this request (bad numerics, a failed step); the engine goes on."""


class ModelLoadError(LlmplugError):
    """Weights, config or tokenizer of a model could not be loaded."""


class EngineDeadError(LlmplugError):
    """The engine failed and cannot serve further requests."""


class EngineStateError(LlmplugError, RuntimeError):
    """The engine cannot do this now (it is asleep, or requests are running); the message says what to do."""


class StartupError(LlmplugError, RuntimeError):
    """The engine cannot be started this way (e.g. worker processes from a script's unguarded top level);
    the message says what to change."""
