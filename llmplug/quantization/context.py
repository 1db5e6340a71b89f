"""The quantization method a model is being built with, for the layers that ask while they are constructed.

A quantized checkpoint's linear layers hold the checkpoint's packed tensors, not a dense weight, so they must
know the method when they are created: the loader builds the model inside `building_with(config)`, and each
layer's constructor calls `checkpoint_method_for(self, prefix)` (a mixture-of-experts layer's stacked experts:
`experts_method_for(self, prefix)`; models pass nothing along; a model plugin's layers get this for free). Light on
purpose: the layers import it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from llmplug.quantization.base import QuantizationConfig

_BUILDING: contextvars.ContextVar[QuantizationConfig | None] = contextvars.ContextVar(
    "llmplug_quantization", default=None
)


@contextlib.contextmanager
def building_with(config: QuantizationConfig | None) -> Iterator[None]:
    """Layers created inside ask `config` for their method (None: every layer dense)."""
    token = _BUILDING.set(config)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def experts_method_for(experts: Any, prefix: str) -> Any:
    """The quantized method of the stacked routed experts named `prefix` in the model being built (None: dense); the
    checkpoint's method refuses by name a quantized MoE checkpoint it cannot hold
    (QuantizationConfig.experts_method)."""
    config = _BUILDING.get()
    return None if config is None else config.experts_method(experts, prefix)


def checkpoint_method_for(layer: Any, prefix: str) -> Any:
    """The quantized method of the linear `layer` named `prefix` in the model being built; None: dense."""
    config = _BUILDING.get()
    return None if config is None else config.linear_method(layer, prefix)
