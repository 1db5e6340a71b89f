"""The parity cases of every architecture llmplug registers: tiny transformers configs, one or more per name.

A case's name is its test id; `architecture(case)` is the registered name it proves (the coverage
test requires one for every entry point of `llmplug.models`). TP_CASES: one case per family run
with tensor parallelism (slow).
"""

from __future__ import annotations

from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from llmplug.testing import ParityCase, tiny_config


def case(name: str, config_class: type, **fields) -> ParityCase:
    """A ParityCase over `tiny_config(config_class, **fields)`."""
    return ParityCase(name, lambda: tiny_config(config_class, **fields))


CASES: list[ParityCase] = [
    # the Llama family: biases, tying, q/k norm, explicit head_dim, scaled rope
    case("LlamaForCausalLM", LlamaConfig, attention_bias=True, mlp_bias=True),
    case("MistralForCausalLM", MistralConfig, head_dim=32, sliding_window=None),
    case("Qwen2ForCausalLM", Qwen2Config, tie_word_embeddings=True),
    case("Qwen3ForCausalLM", Qwen3Config, head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0}),
]

TP_CASES: list[str] = ["LlamaForCausalLM"]


def architecture(case: ParityCase) -> str:
    """The registered architecture a case proves: its name up to the first '-'."""
    return case.name.split("-")[0]
