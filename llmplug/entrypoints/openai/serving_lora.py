"""The LoRA adapters a server offers as models: `--lora-modules` at start-up, vLLM's runtime
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (with `--allow-runtime-lora-updating`), and the
`llmplug.lora_resolvers` plugins asked for a `model` name nothing else knows."""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol, runtime_checkable

from llmplug.core.plugins import PluginRegistry
from llmplug.engine.async_llm import AsyncLLM
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.loggable import loggable
from llmplug.lora.request import LoRARequest

logger = logging.getLogger(__name__)

__all__ = ["LoRAResolver", "ServedAdapters", "parse_lora_modules"]


@runtime_checkable
class LoRAResolver(Protocol):
    """Where adapters come from (the `llmplug.lora_resolvers` entry-point group, after vLLM's LoRAResolver).

    Called by the server, on its event loop, when a request's `model` names neither the base model nor a
    known adapter; returns the adapter's request (its `lora_int_id` is replaced by the server's) or None.
    """

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """The adapter called `lora_name` for `base_model_name`, or None when this resolver has none."""
        ...


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """`name=path` items of `--lora-modules` -> {name: path}; ValueError naming a malformed or repeated one."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules item {spec!r} must be NAME=PATH")
        if name in modules:
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        modules[name] = path
    return modules


class _AdapterIds:
    """The ids of the adapters servers load: increasing, never reused in the process (an id unloaded and given
    to another adapter could meet state kept under the old one)."""

    def __init__(self) -> None:
        self._last = 0
        self._lock = threading.Lock()  # servers on several event loops may share one engine

    def after(self, floor: int) -> int:
        """A new id above every id handed out and above `floor` (the engine's own adapters)."""
        with self._lock:
            self._last = max(self._last, floor) + 1
            return self._last


_ADAPTER_IDS = _AdapterIds()


class ServedAdapters:
    """The adapters served by name, each loaded into the engine (and so checked) before it is listed."""

    def __init__(self, engine: AsyncLLM, base_names: list[str], resolvers: list[Any] = ()):
        self.engine, self.base_names, self.resolvers = engine, base_names, list(resolvers)
        self.by_name: dict[str, LoRARequest] = {}

    @classmethod
    def with_resolvers(cls, engine: AsyncLLM, base_names: list[str], names: list[str],
                       registry: PluginRegistry) -> "ServedAdapters":
        """Adapters with the `llmplug.lora_resolvers` plugins `names` (instantiated without arguments)."""
        resolvers = [registry.load("llmplug.lora_resolvers", name)() for name in names]
        return cls(engine, base_names, resolvers)

    def get(self, name: str) -> LoRARequest | None:
        """The adapter served as `name`, if any."""
        return self.by_name.get(name)

    async def load(self, name: str, path: str) -> LoRARequest:
        """Load and check the adapter folder `path` as model `name`; 400 when the name is taken or it does not fit."""
        if name in self.base_names or name in self.by_name:
            raise OpenAIError(400, f"The model name `{name}` is already served; unload it first or choose another.",
                              param="lora_name", code="lora_name_taken")
        loaded = await self.engine.list_loras()  # the engine may hold adapters of others (offline use, tests)
        request = LoRARequest(name, _ADAPTER_IDS.after(max((r.lora_int_id for r in loaded), default=0)), path)
        await self.engine.add_lora(request)  # InvalidRequestError (a 400) when it does not fit
        self.by_name[name] = request
        logger.info("LoRA adapter %s loaded from %s", loggable(name), loggable(path, 300))  # the client's text
        return request

    async def unload(self, name: str) -> None:
        """Stop serving adapter `name`; 404 when no such adapter is served."""
        request = self.by_name.pop(name, None)
        if request is None:
            raise OpenAIError(404, f"No LoRA adapter `{name}` is loaded.", param="lora_name", code="lora_not_found")
        await self.engine.remove_lora(request.lora_int_id)
        logger.info("LoRA adapter %r unloaded", name)

    async def resolve(self, name: str) -> LoRARequest | None:
        """The adapter served as `name`, asking the resolvers (and loading what they find) for an unknown one."""
        if name in self.by_name or name in self.base_names:
            return self.by_name.get(name)
        for resolver in self.resolvers:
            found = await resolver.resolve_lora(self.base_names[0], name)
            if found is not None:
                return await self.load(name, found.lora_path)
        return None
