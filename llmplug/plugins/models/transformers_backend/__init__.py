"""The transformers backend: any transformers model whose class supports the attention interface, run on
llmplug's paged attention, KV cache and loaders (docs/models.md, "The transformers backend").

Exports `TransformersForCausalLM`, `TransformersForEmbedding` (registered in `llmplug.models`) and
`backend_class` (which of them runs a config).
"""

from llmplug.plugins.models.transformers_backend.model import (
    TransformersForCausalLM,
    TransformersForEmbedding,
    backend_class,
)

__all__ = ["TransformersForCausalLM", "TransformersForEmbedding", "backend_class"]
