"""StableLM (StableLM-3B-4E1T, StableLM 2, Stable Code): LayerNorm with bias, partial rotary, gated SiLU,
optional q/k/v biases and a parallel residual with one norm. Not modelled: `qk_layernorm` (StableLM 2 12B
stores one LayerNorm per head as separate tensors), refused with a clear error."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, refuse, sizes_of

__all__ = ["StableLmForCausalLM"]


def stablelm_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """StableLmForCausalLM."""
    refuse(hf, bool(hf.qk_layernorm), "qk_layernorm (one LayerNorm per head)")
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=layers_of(hf),
        norm=NormConfig("layer", hf.layer_norm_eps, bias=True),
        mlp=MLPConfig(hf.hidden_act),
        qkv_bias=bool(hf.use_qkv_bias),
        parallel_residual=bool(hf.use_parallel_residual),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class StableLmForCausalLM(DecoderForCausalLM):
    """StableLM (HF architecture StableLmForCausalLM)."""

    arch_config_of = staticmethod(stablelm_arch_config)
