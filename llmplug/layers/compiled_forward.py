"""CompiledForward: a model's forward pass captured by torch.compile, with attention left opaque.

The decoder's small ops per layer cost more in eager dispatch than in arithmetic at decode sizes.
torch.compile (inductor) runs them from generated code; on the CPU llmplug's kernels (norms, rotary,
SiLU-and-mul) stay one opaque call each, so the compiled forward computes eager's bits, and elsewhere
inductor fuses the element-wise ops itself. Each Attention call becomes `torch.ops.llmplug.attention`, which
the compiler does not trace into (the backend chooses its path from the step's metadata and writes the KV
cache), so the graph is split around it, as vLLM does.

One graph serves every token count: the token dimension is marked dynamic, so nothing is padded and no
shape bucket is compiled apart (inductor's CPU code takes its sizes at run time; CUDA graphs would need
static sizes, CPU code does not). One graph for all sizes also keeps each token's result independent of
how many others share its step. torch.compile specializes a count of 1, so decode of a single sequence
gets a second graph.

A capture the compiler cannot do falls back to eager for good (logged); a graph break inside the model
is not a failure: dynamo runs the pieces around it. Compiled code is cached by inductor on disk
(`TORCHINDUCTOR_CACHE_DIR`, default `/tmp/torchinductor_<user>`), so a second start reuses it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from llmplug.layers.attention import attention_layers
from llmplug.layers.attention.layer import opaque_attention

__all__ = ["CompiledForward"]

log = logging.getLogger(__name__)


class CompiledForward:
    """Calls `model(input_ids, positions, ...)` through torch.compile; eager if capturing fails."""

    def __init__(self, model: nn.Module, *, freezing: bool = True) -> None:
        self.model = model
        layers = attention_layers(model)
        self.layers = {layer.layer_name: layer for layer in layers}
        if len(self.layers) != len(layers):
            raise ValueError("Attention layers share a layer_name (their prefix): a compiled forward needs them unique")
        # freezing folds the weights into the graph as constants (and lets inductor pre-pack them for
        # oneDNN); a new weight then needs a new CompiledForward
        self.compiled = torch.compile(model, dynamic=True, options={"freezing": freezing})
        self.failed: str | None = None  # why the model runs eager

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        if self.failed is not None:
            return self.model(input_ids, positions, *rest, **kwargs)
        graphs_before = _graph_count()
        start = time.perf_counter()
        try:
            with opaque_attention(self.layers):
                out = self.compiled(input_ids, positions, *rest, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:  # capture failed: the model itself is fine
            self.failed = f"{type(error).__name__}: {error}"
            log.warning("torch.compile could not capture %s; running it eager: %s", type(self.model).__name__, error)
            return self.model(input_ids, positions, *rest, **kwargs)
        if _graph_count() != graphs_before:
            log.info(
                "compiled %s for %d tokens in %.1f s (inductor; cached on disk for the next start)",
                type(self.model).__name__, input_ids.shape[0], time.perf_counter() - start,
            )
        return out


def _graph_count() -> int:
    """Graphs dynamo has captured in this process (grows when a call compiles)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
