"""Parity cases of the transformers backend: architectures llmplug has no native plugin for (transformers'
causal LMs whose classes support the attention interface), each a tiny random config.

A case's name is `TransformersForCausalLM-<model type>` (the coverage test reads the registered name before
the first '-'). FAST_CASES run on every test run; the others (mixture-of-experts layers, whose transformers
reference is slower) are marked slow.
"""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from llmplug.testing import ParityCase, PoolingParityCase
from llmplug.testing.tiny import tiny_config

# short prompts and generations: the backend's correctness does not depend on length, and each case pays
# for a transformers reference
PROMPT_LENGTHS = (3, 11, 20, 29)
MAX_NEW_TOKENS = 10


def backend_case(model_type: str, **fields) -> ParityCase:
    """The backend's parity case of transformers' `model_type` on a tiny config."""
    make = lambda: tiny_config(CONFIG_MAPPING[model_type], **fields)  # noqa: E731
    return ParityCase(f"TransformersForCausalLM-{model_type}", make, PROMPT_LENGTHS, MAX_NEW_TOKENS)


FAST_CASES = [
    backend_case("bitnet"),  # BitLinear-style sub-norms inside attention and MLP
    backend_case("apertus1p5_text"),  # q/k norms, xIELU activation; has a tensor-parallel plan
    backend_case("beam"),  # gated attention output
]
SLOW_CASES = [
    backend_case("gemma4_text"),  # sliding and full layers, per-layer-type rotary
    backend_case("aria_text"),  # mixture of experts with a shared expert
    backend_case("afmoe"),
    backend_case("kolibri1"),
    backend_case("laguna"),
    backend_case("mellum"),
    backend_case("exaone_moe"),
    backend_case("hy_v3"),
]
BACKEND_CASES = FAST_CASES + SLOW_CASES
TP_CASE = "TransformersForCausalLM-apertus1p5_text"

# a causal LM without a native plugin, run as a last-token embedding model (model.convert: embed)
BACKEND_POOLING_CASES = [
    PoolingParityCase(
        "TransformersForEmbedding-bitnet",
        lambda: tiny_config(CONFIG_MAPPING["bitnet"], architectures=["BitNetForCausalLM"]),
        engine_kwargs={"runner": "pooling"},
    ),
]
