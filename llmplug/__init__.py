"""llmplug: an LLM inference and serving engine whose every backend is a plugin.

Exports `LLM`, `SamplingParams`, `LoRARequest` and the output types with vLLM's names, loaded lazily so that
`import llmplug` stays cheap.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "llmplug.engine.llm",
    "AsyncLLM": "llmplug.engine.async_llm",
    "EngineConfig": "llmplug.core.config",
    "SamplingParams": "llmplug.core.params",
    "GuidedDecodingParams": "llmplug.core.params",
    "PoolingParams": "llmplug.core.params",
    "BeamSearchParams": "llmplug.core.params",
    "RequestOutput": "llmplug.core.outputs",
    "CompletionOutput": "llmplug.core.outputs",
    "BeamSearchOutput": "llmplug.core.outputs",
    "BeamSearchSequence": "llmplug.core.outputs",
    "PoolingRequestOutput": "llmplug.core.outputs",
    "EmbeddingRequestOutput": "llmplug.core.outputs",
    "ClassificationRequestOutput": "llmplug.core.outputs",
    "ScoringRequestOutput": "llmplug.core.outputs",
    "LoRARequest": "llmplug.lora.request",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmplug' has no attribute {name!r}")
    import importlib

    if _EXPORTS[name].startswith("llmplug.engine"):
        _configure_threads_before_torch()
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def _configure_threads_before_torch() -> None:
    """The engine imports torch; OpenMP reads its wait policy only then, so set it first."""
    import sys

    if "torch" not in sys.modules:
        from llmplug.platforms.cpu_threads import configure_cpu_threads

        configure_cpu_threads()
