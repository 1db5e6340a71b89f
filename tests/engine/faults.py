"""Faults injected into a running engine, for the tests of how it fails."""

from __future__ import annotations

from llmplug import AsyncLLM


def break_forward(engine: AsyncLLM, message: str) -> None:
    """Make the model's forward pass raise, as a real fault in a step would (a failing kernel, out of memory)."""
    model = engine.llm_engine.engine_core.executor.worker.model_runner.model

    def forward(*args, **kwargs):
        raise RuntimeError(message)

    model.forward = forward
