"""EXAONE 4: OLMo 2's layer (a norm after each sublayer, none before) with RMSNorm on each q and k head, and
local (windowed) layers interleaved with global ones that have no rotary (NoPE) when the config sets a window.
Checkpoint names are transformers' Llama names. (EXAONE 3 is Llama: see `llama.py`.)"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.plugins.models.arch_config import SLIDING, layers_of
from llmplug.plugins.models.llama import llama_fields

__all__ = ["Exaone4ForCausalLM"]


def exaone4_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Exaone4ForCausalLM."""
    nope = {i for i, kind in enumerate(hf.layer_types) if kind != SLIDING} if hf.sliding_window else set()
    fields = llama_fields(hf) | {"layers": layers_of(hf, nope_layers=nope)}
    qk_norm = QKNormConfig(NormConfig("rms", hf.rms_norm_eps))
    return DecoderArchConfig(**fields, qk_norm=qk_norm, pre_norm=False, post_norm=True)


class Exaone4ForCausalLM(DecoderForCausalLM):
    """EXAONE 4.0 (HF architecture Exaone4ForCausalLM)."""

    arch_config_of = staticmethod(exaone4_arch_config)
