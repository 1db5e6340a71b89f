"""Faults injected into a running engine (an `LLM` or `AsyncLLM`), for the tests of how it fails.

Each fault acts where a real one would: in the model's forward pass or in the logits the sampler
gets, inside an engine step, on the engine's only (in-process) worker.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from llmplug.layers.vocab_embedding import VocabParallelEmbedding


def model_runner(engine: Any) -> Any:
    """The ModelRunner of an LLM's or AsyncLLM's in-process worker."""
    return engine.llm_engine.engine_core.executor.worker.model_runner


def break_forward(engine: Any, message: str, *, error: type[BaseException] = RuntimeError, after: int = 0) -> None:
    """Make every forward pass after the first `after` raise `error(message)`, as a real fault in a step would
    (a failing kernel, out of memory). Before raising, the pass writes NaN K/V into the cache slots of the
    step, as a pass that failed half-way leaves them: a block named for that step must never be reused."""
    model = model_runner(engine).model
    forward = model.forward
    calls = iter(range(after))

    def broken(*args, **kwargs):
        if next(calls, None) is not None:
            return forward(*args, **kwargs)
        with nan_embeddings(model):
            forward(*args, **kwargs)
        raise error(message)

    model.forward = broken  # an instance attribute over the class's method; `heal` removes it


def block_forward(engine: Any, release: threading.Event) -> None:
    """Make the next forward pass wait until `release` is set, as a hung kernel or collective would stall a
    step; the passes after it run as before."""
    model = model_runner(engine).model
    forward = model.forward

    def blocked(*args, **kwargs):
        del model.forward  # this pass only: the class's method is back for the next
        release.wait()
        return forward(*args, **kwargs)

    model.forward = blocked


@contextlib.contextmanager
def nan_embeddings(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the model's token embeddings are NaN, so every K/V it computes is NaN."""
    hooks = [
        m.register_forward_hook(lambda module, args, out: torch.full_like(out, float("nan")))
        for m in model.modules()
        if type(m) is VocabParallelEmbedding
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


class _PoisonedSampler:
    """The engine's sampler, after setting to NaN the logits of the rows `poisoned(prompt_token_ids)` selects."""

    def __init__(self, sampler: Any, state: Any, poisoned: Callable[[list[int]], bool]) -> None:
        self.sampler, self.state, self.poisoned = sampler, state, poisoned

    def __call__(self, logits: torch.Tensor, metadata: Any, bitmask: torch.Tensor | None = None) -> Any:
        rows = [i for i, r in enumerate(metadata.req_ids) if self.poisoned(self.state.requests[r].prompt_token_ids)]
        logits[rows] = float("nan")
        return self.sampler(logits, metadata, bitmask)


def nan_logits(engine: Any, prompt_token_ids: list[int]) -> None:
    """From now on, the logits of every request whose prompt is `prompt_token_ids` are NaN (bad numerics in one row)."""
    runner = model_runner(engine)
    runner.sampler = _PoisonedSampler(runner.sampler, runner.sampling_state, lambda p: p == prompt_token_ids)


def nan_hidden_states(engine: Any, num_tokens: int) -> None:
    """From now on, a pooling model's hidden states are NaN for every prompt of `num_tokens` tokens (bad numerics
    in one request of the batch), as its pooler receives them."""
    model = model_runner(engine).model
    pooler = model.pooler

    def poisoned(hidden_states: torch.Tensor, metadata: Any) -> Any:
        hidden_states = hidden_states.clone()
        for start, length in zip(metadata.starts, metadata.lens):
            if length == num_tokens:
                hidden_states[start : start + length] = float("nan")
        return pooler(hidden_states, metadata)

    model.pooler = poisoned  # an instance attribute over the class's method; `heal` removes it


def heal(engine: Any) -> None:
    """Undo `nan_logits`, `break_forward` and `nan_hidden_states`."""
    runner = model_runner(engine)
    if isinstance(runner.sampler, _PoisonedSampler):
        runner.sampler = runner.sampler.sampler
    runner.model.__dict__.pop("forward", None)
    runner.model.__dict__.pop("pooler", None)
