"""The transformers backend: transformers' own model classes run on llmplug's loaders — text decoders and the
language models of vision-language models on llmplug's paged attention and KV cache, encoders (pooling) on whole
prompts with transformers' attention (docs/models.md, "The transformers backend").

Exports `TransformersForCausalLM`, `TransformersForEmbedding` (registered in `llmplug.models`),
`TransformersForMultimodalLM`, `TransformersEncoderForEmbedding`, `TransformersEncoderForSequenceClassification`
and `backend_class` (which of them runs a config).
"""

from llmplug.plugins.models.transformers_backend.encoder import (
    TransformersEncoderForEmbedding,
    TransformersEncoderForSequenceClassification,
)
from llmplug.plugins.models.transformers_backend.model import (
    TransformersForCausalLM,
    TransformersForEmbedding,
    backend_class,
)
from llmplug.plugins.models.transformers_backend.multimodal import TransformersForMultimodalLM

__all__ = [
    "TransformersEncoderForEmbedding",
    "TransformersEncoderForSequenceClassification",
    "TransformersForCausalLM",
    "TransformersForEmbedding",
    "TransformersForMultimodalLM",
    "backend_class",
]
