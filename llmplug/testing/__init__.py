"""llmplug.testing: prove a model architecture against transformers, as llmplug's own tests do.

- `tiny_config`, `save_tiny_checkpoint`, `randomize_`: a tiny random checkpoint written by transformers;
- `ParityCase`, `ParityRunner`, `VARIANTS`: greedy generation through the whole engine (plain,
  chunked prefill, preemption, tensor parallel) against transformers' `generate`, tokens and
  log-probabilities;
- `PagedHarness`: a minimal paged runner for model-level logits checks.

See docs/plugins.md ("Testing a model architecture").
"""

from llmplug.testing.paged import PagedHarness
from llmplug.testing.parity import VARIANTS, Completion, ParityCase, ParityReport, ParityRunner, Reference, Variant
from llmplug.testing.tiny import TINY_SIZES, TinyCheckpoint, randomize_, save_tiny_checkpoint, tiny_config

__all__ = [
    "TINY_SIZES",
    "VARIANTS",
    "Completion",
    "PagedHarness",
    "ParityCase",
    "ParityReport",
    "ParityRunner",
    "Reference",
    "TinyCheckpoint",
    "Variant",
    "randomize_",
    "save_tiny_checkpoint",
    "tiny_config",
]
