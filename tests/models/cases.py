"""The parity cases of every architecture llmplug registers: tiny transformers configs, one or more per name.

A case's name is its test id; `architecture(case)` is the registered name it proves (the coverage
test requires one for every entry point of `llmplug.models`). TP_CASES: one case per family run
with tensor parallelism (slow).
"""

from __future__ import annotations

from transformers import (
    BloomConfig,
    CohereConfig,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPTNeoConfig,
    GemmaConfig,
    GPT2Config,
    GPTJConfig,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MptConfig,
    NemotronConfig,
    OlmoConfig,
    Olmo2Config,
    Olmo3Config,
    OPTConfig,
    PersimmonConfig,
    PhiConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
    StableLmConfig,
    Starcoder2Config,
    XGLMConfig,
)

from llmplug.testing import ParityCase, tiny_config


WINDOW = 8  # sliding windows far shorter than prompt + generation (up to 29 + 24 tokens)
NO_POSITION_LIMIT = {"max_model_len": 256}  # ALiBi models: the config has no max_position_embeddings


def case(
    name: str, config_class: type, engine_kwargs: dict | None = None, hf_attn: str = "eager", **fields
) -> ParityCase:
    """A ParityCase over `tiny_config(config_class, **fields)`."""
    make = lambda: tiny_config(config_class, **fields)  # noqa: E731
    return ParityCase(name, make, engine_kwargs=engine_kwargs or {}, hf_attn_implementation=hf_attn)


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
    case("Phi3ForCausalLM", Phi3Config, partial_rotary_factor=0.75, tie_word_embeddings=False, sliding_window=WINDOW),
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
    # plain GELU MLP with biases, LayerNorm, a window on every layer
    case("Starcoder2ForCausalLM", Starcoder2Config, sliding_window=WINDOW),
    # sinusoidal positions at offset 2, scaled embeddings
    case("XGLMForCausalLM", XGLMConfig, ffn_dim=128),
    # LayerNorm 1 + w, squared ReLU, partial rotary
    case("NemotronForCausalLM", NemotronConfig),
    # per-head interleaved fused qkv, q/k LayerNorm with bias, squared ReLU
    case("PersimmonForCausalLM", PersimmonConfig),
    # sandwich norms, attention and final logit soft-caps, query_pre_attn_scalar, alternating windows
    case(
        "Gemma2ForCausalLM",
        Gemma2Config,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
    ),
    # Gemma 2 without soft-caps, q/k norms with 1 + w, a rope per layer type (local and global, scaled)
    case(
        "Gemma3ForCausalLM",
        Gemma3TextConfig,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    ),
    # ALiBi, a LayerNorm after the embeddings, per-head fused qkv
    case("BloomForCausalLM", BloomConfig, NO_POSITION_LIMIT),
    # parallel attention + MLP from one norm, multi-query (Falcon-7B)
    case("FalconForCausalLM", FalconConfig),
    # the new decoder architecture: two norms, grouped KV heads in the fused qkv (Falcon-40B)
    case("FalconForCausalLM-new", FalconConfig, new_decoder_architecture=True, num_kv_heads=2, bias=False),
    # ALiBi scaled with the scores, sequential layers, biases (Falcon-RW); transformers' eager Falcon adds
    # the ALiBi bias twice (once in its mask, once again in the scores), its SDPA path once
    case(
        "FalconForCausalLM-alibi",
        FalconConfig,
        NO_POSITION_LIMIT,
        hf_attn="sdpa",
        alibi=True,
        multi_query=False,
        parallel_attn=False,
        bias=True,
    ),
    # ALiBi, bias-free LayerNorm, clip_qkv (transformers' MPT ignores alibi_bias_max: keep its default 8)
    case("MptForCausalLM", MptConfig, NO_POSITION_LIMIT, attn_config={"alibi": True, "clip_qkv": 0.3}),
    # unscaled attention, learned positions, alternating global and local (windowed) layers
    case(
        "GPTNeoForCausalLM",
        GPTNeoConfig,
        attention_types=[[["global", "local"], 1]],
        window_size=WINDOW,
        intermediate_size=128,
    ),
    # NoPE: the second layer has no rotary
    case("SmolLM3ForCausalLM", SmolLM3Config, no_rope_layer_interval=2),
    # OLMo 2 with a window on the first layer and a rope per layer type
    case(
        "Olmo3ForCausalLM",
        Olmo3Config,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        },
    ),
]

# one case per family module, the one whose blocks shard the most ways (q/k norms, ALiBi slopes, 1 KV head)
TP_CASES: list[str] = [
    "LlamaForCausalLM",
    "Gemma3ForCausalLM",
    "PhiForCausalLM",
    "GPTNeoXForCausalLM",
    "GPTJForCausalLM",
    "GPT2LMHeadModel",
    "OPTForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "CohereForCausalLM",
    "StableLmForCausalLM-parallel",
    "Starcoder2ForCausalLM",
    "XGLMForCausalLM",
    "NemotronForCausalLM",
    "PersimmonForCausalLM",
    "BloomForCausalLM",
    "FalconForCausalLM",
    "MptForCausalLM",
    "GPTNeoForCausalLM",
]
# pipeline parallelism (PP=2, one layer per stage) where a stage boundary meets a family's structure:
# positions and a tied head on different stages, sandwich norms, post-sublayer norms
PP_CASES: list[str] = ["GPT2LMHeadModel", "Gemma2ForCausalLM", "Olmo2ForCausalLM"]


def architecture(case: ParityCase) -> str:
    """The registered architecture a case proves: its name up to the first '-'."""
    return case.name.split("-")[0]


# the mixture-of-experts and latent-attention architectures, in their own module (they use `case` above)
from .cases_moe import EP_CASES, MOE_CASES, MOE_TP_CASES  # noqa: E402

CASES += MOE_CASES
TP_CASES += MOE_TP_CASES
