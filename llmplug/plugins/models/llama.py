"""The Llama family: Llama, Mistral, Qwen2, Qwen3, SmolLM3 — the generic decoder with RMSNorm, RoPE, gated SiLU.

They differ only in biases, q/k norms, tying, sliding windows and NoPE layers; their checkpoints use
the decoder's own (transformers' Llama) names, so no `CheckpointNames` is needed. Their
`*ForSequenceClassification` (classifiers, rerankers, reward models: last-token pooling into a
`score` head) are the causal LMs' pooling twins.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig, as_pooling_model
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = [
    "LlamaForCausalLM",
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
    """MistralForCausalLM: no biases; `sliding_window` on every layer."""
    return DecoderArchConfig(**llama_fields(hf))


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


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral (HF architecture MistralForCausalLM)."""

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
