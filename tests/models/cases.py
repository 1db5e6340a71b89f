"""The parity cases of every architecture llmplug registers: tiny transformers configs, one or more per name.

A case's name is its test id; `architecture(case)` is the registered name it proves (the coverage
test requires one for every entry point of `llmplug.models`). TP_CASES: one case per family run
with tensor parallelism (slow).
"""

from __future__ import annotations

from transformers import (
    CohereConfig,
    GemmaConfig,
    GPT2Config,
    GPTJConfig,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    NemotronConfig,
    OlmoConfig,
    Olmo2Config,
    OPTConfig,
    PersimmonConfig,
    PhiConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    StableLmConfig,
    Starcoder2Config,
    XGLMConfig,
)

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
    # RMSNorm 1 + w, GeGLU, sqrt(hidden) embedding scale
    case("GemmaForCausalLM", GemmaConfig, head_dim=16),
    # parallel residual with one LayerNorm, partial rotary, q/k LayerNorm, lm_head bias
    case("PhiForCausalLM", PhiConfig, partial_rotary_factor=0.5, qk_layernorm=True),
    # fused qkv_proj / gate_up_proj checkpoint tensors, partial rotary (Phi-4-mini)
    case("Phi3ForCausalLM", Phi3Config, partial_rotary_factor=0.75, tie_word_embeddings=False),
    # parallel residual with two norms, per-head interleaved fused qkv, partial rotary; and sequential
    case("GPTNeoXForCausalLM", GPTNeoXConfig, partial_rotary_factor=0.25),
    case("GPTNeoXForCausalLM-sequential", GPTNeoXConfig, use_parallel_residual=False, attention_bias=False),
    # interleaved (GPT-J style) partial rotary, parallel residual, lm_head bias
    case("GPTJForCausalLM", GPTJConfig, rotary_dim=8, n_inner=128),
    # learned positions, Conv1D weights, fused c_attn
    case("GPT2LMHeadModel", GPT2Config, n_inner=128),
    # learned positions at offset 2, ReLU
    case("OPTForCausalLM", OPTConfig, ffn_dim=128),
    # weightless LayerNorm, clip_qkv small enough to clip
    case("OlmoForCausalLM", OlmoConfig, clip_qkv=0.3),
    # post-sublayer norms, q/k RMSNorm over the whole projection
    case("Olmo2ForCausalLM", Olmo2Config),
    # embedding, residual, attention and logits multipliers
    case(
        "GraniteForCausalLM",
        GraniteConfig,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=4.0,
    ),
    # parallel residual, bias-free LayerNorm, interleaved rotary, per-head q/k LayerNorm weights, logit scale
    case("CohereForCausalLM", CohereConfig, use_qk_norm=True, logit_scale=0.5),
    # LayerNorm with bias, partial rotary, q/k/v bias; and the parallel-residual variant
    case("StableLmForCausalLM", StableLmConfig, partial_rotary_factor=0.25, use_qkv_bias=True),
    case("StableLmForCausalLM-parallel", StableLmConfig, use_parallel_residual=True),
    # plain GELU MLP with biases, LayerNorm
    case("Starcoder2ForCausalLM", Starcoder2Config, sliding_window=None),
    # sinusoidal positions at offset 2, scaled embeddings
    case("XGLMForCausalLM", XGLMConfig, ffn_dim=128),
    # LayerNorm 1 + w, squared ReLU, partial rotary
    case("NemotronForCausalLM", NemotronConfig),
    # per-head interleaved fused qkv, q/k LayerNorm with bias, squared ReLU
    case("PersimmonForCausalLM", PersimmonConfig),
]

TP_CASES: list[str] = ["LlamaForCausalLM"]


def architecture(case: ParityCase) -> str:
    """The registered architecture a case proves: its name up to the first '-'."""
    return case.name.split("-")[0]
