"""MPT: ALiBi, LayerNorm without bias, q/k/v fused, clip_qkv, GELU MLP, no biases (transformers' MPT
builds none, whatever `no_bias` says). The ALiBi slopes follow `attn_config.alibi_bias_max`, as MPT's
own code does (transformers always uses 8, the value of every published MPT). Not modelled: `qk_ln`
(transformers ignores it too), refused."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import QKV_CONTIGUOUS, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, refuse, sizes_of

__all__ = ["MptForCausalLM"]

MPT_NAMES = CheckpointNames(
    prefixes={
        "transformer.wte": "model.embed_tokens",
        "transformer.blocks": "model.layers",
        "transformer.norm_f": "model.norm",
    },
    renames={
        "norm_1": "input_layernorm",
        "norm_2": "post_attention_layernorm",
        "attn.Wqkv": "self_attn.qkv_proj",
        "attn.out_proj": "self_attn.o_proj",
        "ffn": "mlp",
    },
    fused={"self_attn.qkv_proj": QKV_CONTIGUOUS},
)
MPT_EXPANSION = 4  # transformers' MptMLP is 4 * d_model wide whatever expansion_ratio says


def mpt_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """MptForCausalLM."""
    attn = hf.attn_config
    refuse(hf, bool(attn.qk_ln), "attn_config.qk_ln")
    refuse(hf, not attn.alibi, "attn_config.alibi=False (learned positions)")
    refuse(hf, hf.expansion_ratio != MPT_EXPANSION, f"expansion_ratio={hf.expansion_ratio} (transformers builds 4)")
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=MPT_EXPANSION * hf.hidden_size),
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", hf.layer_norm_epsilon),
        mlp=MLPConfig("gelu", gated=False),
        clip_qkv=attn.clip_qkv,
        attention_scale=attn.softmax_scale,
        alibi=True,
        alibi_max_bias=float(attn.alibi_bias_max),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class MptForCausalLM(DecoderForCausalLM):
    """MPT (HF architecture MptForCausalLM)."""

    arch_config_of = staticmethod(mpt_arch_config)
    checkpoint_names = MPT_NAMES
