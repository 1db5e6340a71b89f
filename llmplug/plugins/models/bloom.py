"""BLOOM: ALiBi instead of positions, a LayerNorm right after the embeddings, LayerNorm with bias,
tanh-GELU MLP, q/k/v fused per head in the checkpoint. Hub checkpoints (bigscience/bloom-*) lack the
`transformer.` prefix; both spellings load. BLOOM has no position limit: give `max_model_len`.
Not modelled: `apply_residual_connection_post_layernorm` (refused)."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import QKV_PER_HEAD, CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, refuse, sizes_of

__all__ = ["BloomForCausalLM"]

_TOP = {
    "word_embeddings": "model.embed_tokens",
    "word_embeddings_layernorm": "model.embed_norm",
    "h": "model.layers",
    "ln_f": "model.norm",
}
BLOOM_NAMES = CheckpointNames(
    prefixes={**_TOP, **{f"transformer.{k}": v for k, v in _TOP.items()}},
    renames={
        "self_attention.query_key_value": "self_attn.qkv_proj",
        "self_attention.dense": "self_attn.o_proj",
        "mlp.dense_h_to_4h": "mlp.up_proj",
        "mlp.dense_4h_to_h": "mlp.down_proj",
    },
    fused={"self_attn.qkv_proj": QKV_PER_HEAD},
)


def bloom_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """BloomForCausalLM."""
    refuse(hf, bool(hf.apply_residual_connection_post_layernorm), "apply_residual_connection_post_layernorm")
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=4 * hf.hidden_size),
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", hf.layer_norm_epsilon, bias=True),
        mlp=MLPConfig("gelu_pytorch_tanh", gated=False, bias=True),
        qkv_bias=True,
        o_proj_bias=True,
        alibi=True,
        embedding_norm=True,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class BloomForCausalLM(DecoderForCausalLM):
    """BLOOM, BLOOMZ (HF architecture BloomForCausalLM)."""

    arch_config_of = staticmethod(bloom_arch_config)
    checkpoint_names = BLOOM_NAMES
