"""The Llama family: Llama, Mistral, Ministral, Ministral 3, CWM, Qwen2, Qwen3, SmolLM3 — the generic decoder
with RMSNorm, RoPE, gated SiLU.

They differ only in biases, q/k norms, tying, sliding windows, NoPE layers and Ministral 3's position-dependent
query scale; their checkpoints use the decoder's own (transformers' Llama) names. Config-only aliases that
transformers runs as Llama (model types exaone, internlm3, iquestcoder) are registered under the class names
their hub checkpoints give; EXAONE 3's checkpoints keep their own tensor names (`EXAONE_NAMES`), also when
transformers re-saves them as LlamaForCausalLM.
Their `*ForSequenceClassification` (classifiers, rerankers, reward models: last-token pooling into a
`score` head) are the causal LMs' pooling twins.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig, as_pooling_model
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = [
    "CwmForCausalLM",
    "ExaoneForCausalLM",
    "IQuestCoderForCausalLM",
    "InternLM3ForCausalLM",
    "LlamaForCausalLM",
    "Ministral3ForCausalLM",
    "MinistralForCausalLM",
    "LlamaForSequenceClassification",
    "MistralForCausalLM",
    "MistralForSequenceClassification",
    "Qwen2ForCausalLM",
    "Qwen2ForSequenceClassification",
    "Qwen3ForCausalLM",
    "Qwen3ForSequenceClassification",
    "SmolLM3ForCausalLM",
    "llama_fields",
]


# EXAONE 3 / 3.5 (model type exaone): Llama with GPT-2-like tensor names
EXAONE_NAMES = CheckpointNames(
    prefixes={"transformer.wte": "model.embed_tokens", "transformer.h": "model.layers", "transformer.ln_f": "model.norm"},
    renames={
        "attn.attention": "self_attn",
        "out_proj": "o_proj",
        "ln_1": "input_layernorm",
        "ln_2": "post_attention_layernorm",
        "mlp.c_fc_0": "mlp.gate_proj",
        "mlp.c_fc_1": "mlp.up_proj",
        "mlp.c_proj": "mlp.down_proj",
    },
)


def llama_checkpoint_names(hf: PretrainedConfig) -> CheckpointNames:
    """EXAONE 3's names for its model type (transformers saves such checkpoints as LlamaForCausalLM), else Llama's."""
    return EXAONE_NAMES if hf.model_type == "exaone" else CheckpointNames()


def llama_fields(hf: PretrainedConfig, norm: NormConfig | None = None) -> dict[str, Any]:
    """The DecoderArchConfig fields every Llama-like config carries (sizes, rope, MLP, tying), with
    RMSNorm of `rms_norm_eps` unless `norm` is given."""
    return dict(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=norm or NormConfig("rms", hf.rms_norm_eps),
        mlp=MLPConfig(getattr(hf, "hidden_act", "silu"), bias=bool(getattr(hf, "mlp_bias", False))),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def llama_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """LlamaForCausalLM: `attention_bias` on q, k, v and o; optional `mlp_bias`."""
    bias = bool(getattr(hf, "attention_bias", False))
    return DecoderArchConfig(**llama_fields(hf), qkv_bias=bias, o_proj_bias=bias)


def mistral_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """MistralForCausalLM: no biases; `sliding_window` on every layer. Also MinistralForCausalLM and
    CwmForCausalLM, whose `layer_types` say which layers have the window."""
    return DecoderArchConfig(**llama_fields(hf))


def ministral3_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Ministral3ForCausalLM: Mistral, and q scaled by 1 + beta * log(1 + floor(p / original context)) (Llama 4's
    attention temperature) when the rope parameters give `llama_4_scaling_beta`."""
    rope = hf.rope_parameters
    beta = rope.get("llama_4_scaling_beta")
    scale = None if beta is None else (float(beta), int(rope["original_max_position_embeddings"]))
    return DecoderArchConfig(**llama_fields(hf), query_position_scale=scale)


def qwen2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen2ForCausalLM: bias on q, k, v only; sliding window on the layers `layer_types` says."""
    return DecoderArchConfig(**llama_fields(hf), qkv_bias=True)


def qwen3_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen3ForCausalLM: RMSNorm on each q and k head; `attention_bias` on q, k, v and o."""
    bias = bool(getattr(hf, "attention_bias", False))
    qk_norm = QKNormConfig(NormConfig("rms", hf.rms_norm_eps))
    return DecoderArchConfig(**llama_fields(hf), qkv_bias=bias, o_proj_bias=bias, qk_norm=qk_norm)


def smollm3_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """SmolLM3ForCausalLM: no rotary on the layers `no_rope_layers` marks 0 (NoPE)."""
    bias = bool(hf.attention_bias)
    nope = {i for i, use_rope in enumerate(hf.no_rope_layers) if not use_rope}
    fields = llama_fields(hf) | {"layers": layers_of(hf, nope_layers=nope)}
    return DecoderArchConfig(**fields, qkv_bias=bias, o_proj_bias=bias)


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 1-3, SmolLM, TinyLlama, ... (HF architecture LlamaForCausalLM)."""

    arch_config_of = staticmethod(llama_arch_config)
    checkpoint_names_of = staticmethod(llama_checkpoint_names)


class ExaoneForCausalLM(DecoderForCausalLM):
    """EXAONE 3 / 3.5 (hub architecture ExaoneForCausalLM; transformers runs it as Llama)."""

    arch_config_of = staticmethod(llama_arch_config)
    checkpoint_names = EXAONE_NAMES


class InternLM3ForCausalLM(DecoderForCausalLM):
    """InternLM 3 (hub architecture InternLM3ForCausalLM; transformers runs it as Llama)."""

    arch_config_of = staticmethod(llama_arch_config)


class IQuestCoderForCausalLM(DecoderForCausalLM):
    """IQuest-Coder (hub architecture IQuestCoderForCausalLM; transformers runs it as Llama)."""

    arch_config_of = staticmethod(llama_arch_config)


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral (HF architecture MistralForCausalLM)."""

    arch_config_of = staticmethod(mistral_arch_config)


class MinistralForCausalLM(DecoderForCausalLM):
    """Ministral 8B (HF architecture MinistralForCausalLM)."""

    arch_config_of = staticmethod(mistral_arch_config)


class Ministral3ForCausalLM(DecoderForCausalLM):
    """Ministral 3 text models (HF architecture Ministral3ForCausalLM)."""

    arch_config_of = staticmethod(ministral3_arch_config)


class CwmForCausalLM(DecoderForCausalLM):
    """Code World Model (HF architecture CwmForCausalLM): Llama with windowed layers."""

    arch_config_of = staticmethod(mistral_arch_config)


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5 (HF architecture Qwen2ForCausalLM)."""

    arch_config_of = staticmethod(qwen2_arch_config)


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 dense (HF architecture Qwen3ForCausalLM)."""

    arch_config_of = staticmethod(qwen3_arch_config)


class SmolLM3ForCausalLM(DecoderForCausalLM):
    """SmolLM3 (HF architecture SmolLM3ForCausalLM)."""

    arch_config_of = staticmethod(smollm3_arch_config)


LlamaForSequenceClassification = as_pooling_model(LlamaForCausalLM, classify=True)
MistralForSequenceClassification = as_pooling_model(MistralForCausalLM, classify=True)
Qwen2ForSequenceClassification = as_pooling_model(Qwen2ForCausalLM, classify=True)
Qwen3ForSequenceClassification = as_pooling_model(Qwen3ForCausalLM, classify=True)
