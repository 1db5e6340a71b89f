"""llmplug.testing: prove a model architecture against transformers, as llmplug's own tests do.

- `tiny_config`, `save_tiny_checkpoint`, `randomize_`: a tiny random checkpoint written by transformers;
- `ParityCase`, `ParityRunner`, `VARIANTS`: greedy generation through the whole engine (plain,
  chunked prefill, preemption, tensor parallel) against transformers' `generate`, tokens and
  log-probabilities;
- `MultimodalParityCase`, `MultimodalParityRunner`, `MULTIMODAL_VARIANTS`: a vision-language model through the
  engine with pictures against transformers' `generate` on its processor's output (plain, chunked inside an
  image, preempted, tensor parallel), and prefix caching by picture;
- `PagedHarness`: a minimal paged runner for model-level logits checks;
- `PoolingParityCase`, `PoolingParityRunner`: pooling models (embeddings, classifiers) through the
  engine against transformers' pooled hidden states and logits;
- `save_quantized_checkpoint`, `check_quantization_method`: a quantization method (`llmplug.quantization`)
  through the engine: each quantized layer against its own dequantized weight, row invariance, and the logits
  against transformers on the dequantized weights;
- `check_attention_backend`, `AttentionReport`: an attention backend (`llmplug.attention`) against dense attention
  through prompts, chunked prefill, decodes and prefix hits, one scenario per feature it implements, its refusal
  of the others and its batch-invariance claim;
- `tiny_whisper_tokenizer`: a Whisper tokenizer of a few hundred BPE tokens and Whisper's special tokens, for a
  tiny random speech checkpoint with the real `WhisperProcessor`;
- `check_kv_connector`, `KVConnectorReport`: a KV connector (`llmplug.kv_connectors`) through the engine: save/load
  round trip, partial hits, failed loads recomputed, with the tokens of an engine without it.

See docs/plugins.md ("Testing a model architecture", "Quantization methods") and docs/multimodal.md.
"""

from llmplug.testing.attention import AttentionReport, check_attention_backend
from llmplug.testing.kv_connectors import KVConnectorReport, check_kv_connector
from llmplug.testing.multimodal import (
    MULTIMODAL_VARIANTS,
    MultimodalParityCase,
    MultimodalParityReport,
    MultimodalParityRunner,
    MultimodalPrompt,
    MultimodalReference,
    processor_inputs,
)
from llmplug.testing.paged import PagedHarness
from llmplug.testing.pooling import PoolingParityCase, PoolingParityRunner, PoolingReport
from llmplug.testing.parity import VARIANTS, Completion, ParityCase, ParityReport, ParityRunner, Reference, Variant
from llmplug.testing.quantization import (
    LayerCheck,
    QuantizationReport,
    check_quantization_method,
    save_quantized_checkpoint,
)
from llmplug.testing.tiny import TINY_SIZES, TinyCheckpoint, randomize_, save_tiny_checkpoint, tiny_config
from llmplug.testing.whisper import tiny_whisper_tokenizer

__all__ = [
    "MULTIMODAL_VARIANTS",
    "TINY_SIZES",
    "VARIANTS",
    "AttentionReport",
    "Completion",
    "KVConnectorReport",
    "LayerCheck",
    "MultimodalParityCase",
    "MultimodalParityReport",
    "MultimodalParityRunner",
    "MultimodalPrompt",
    "MultimodalReference",
    "PagedHarness",
    "PoolingParityCase",
    "PoolingParityRunner",
    "PoolingReport",
    "QuantizationReport",
    "ParityCase",
    "ParityReport",
    "ParityRunner",
    "Reference",
    "TinyCheckpoint",
    "Variant",
    "check_attention_backend",
    "check_kv_connector",
    "check_quantization_method",
    "processor_inputs",
    "randomize_",
    "save_quantized_checkpoint",
    "save_tiny_checkpoint",
    "tiny_config",
    "tiny_whisper_tokenizer",
]
