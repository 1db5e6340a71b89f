"""Falcon: LayerNorm, GELU MLP, rotary or ALiBi (whose bias Falcon scales with the scores), and three
layer shapes — parallel attention and MLP from one norm (Falcon-7B), from two norms with grouped KV
heads (the "new decoder architecture", Falcon-40B/180B), or sequential (Falcon-RW). q/k/v are fused in
the checkpoint in the layout each shape implies. transformers rounds Falcon's ALiBi slopes through bfloat16,
which changes nothing for power-of-two head counts (Falcon-RW-1B) and a little for others."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import QKV_CONTIGUOUS, QKV_GROUPED, QKV_PER_HEAD, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["FalconForCausalLM"]


def _names(qkv_layout: str) -> CheckpointNames:
    return CheckpointNames(
        prefixes={
            "transformer.word_embeddings": "model.embed_tokens",
            "transformer.h": "model.layers",
            "transformer.ln_f": "model.norm",
        },
        renames={
            "ln_attn": "input_layernorm",
            "ln_mlp": "post_attention_layernorm",  # the MLP's own norm (DecoderLayer's parallel_mlp_norm)
            "self_attention.query_key_value": "self_attn.qkv_proj",
            "self_attention.dense": "self_attn.o_proj",
            "mlp.dense_h_to_4h": "mlp.up_proj",
            "mlp.dense_4h_to_h": "mlp.down_proj",
        },
        fused={"self_attn.qkv_proj": qkv_layout},
    )


FALCON_NAMES = {layout: _names(layout) for layout in (QKV_CONTIGUOUS, QKV_GROUPED, QKV_PER_HEAD)}


def falcon_checkpoint_names(hf: PretrainedConfig) -> CheckpointNames:
    """The names, with the fused q/k/v layout of this config's layer shape."""
    return FALCON_NAMES[_qkv_layout(hf)]


def _num_kv_heads(hf: PretrainedConfig) -> int:
    if hf.new_decoder_architecture:
        return hf.num_kv_heads
    return 1 if hf.multi_query else hf.num_attention_heads


def _qkv_layout(hf: PretrainedConfig) -> str:
    if hf.new_decoder_architecture:
        return QKV_GROUPED
    return QKV_CONTIGUOUS if hf.multi_query else QKV_PER_HEAD


def falcon_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """FalconForCausalLM."""
    parallel = bool(hf.parallel_attn or hf.new_decoder_architecture)
    two_norms = bool(hf.new_decoder_architecture and (hf.num_ln_in_parallel_attn or 2) == 2)
    sizes = sizes_of(hf, intermediate_size=hf.ffn_hidden_size or 4 * hf.hidden_size) | {
        "num_kv_heads": _num_kv_heads(hf)
    }
    return DecoderArchConfig(
        **sizes,
        layers=layers_of(hf, rope=not hf.alibi),
        norm=NormConfig("layer", hf.layer_norm_epsilon, bias=True),
        mlp=MLPConfig(hf.activation, gated=False, bias=bool(hf.bias)),
        qkv_bias=bool(hf.bias),
        o_proj_bias=bool(hf.bias),
        alibi=bool(hf.alibi),
        alibi_scaled=bool(hf.alibi),
        parallel_residual=parallel,
        parallel_mlp_norm=two_norms,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class FalconForCausalLM(DecoderForCausalLM):
    """Falcon (HF architecture FalconForCausalLM)."""

    arch_config_of = staticmethod(falcon_arch_config)
    checkpoint_names_of = staticmethod(falcon_checkpoint_names)
