"""OPT: learned positions read from row `position + 2`, LayerNorm, ReLU MLP (fc1, fc2), biases everywhere.

OPT-350m puts the LayerNorm after each residual add (`do_layer_norm_before=False`, post-LN, then no final
norm) and keeps embeddings narrower than the layers (`word_embed_proj_dim`), projected in after the
embedding and out before the tied head. Hub checkpoints (facebook/opt-*) are saved without the `model.`
prefix; both spellings load.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.plugins.models.arch_config import layers_of, sizes_of

__all__ = ["OPTForCausalLM"]

_TOP = {
    "embed_tokens": "model.embed_tokens",
    "embed_positions": "model.embed_positions",
    "final_layer_norm": "model.norm",
    "layers": "model.layers",
    "project_in": "model.project_in",
    "project_out": "model.project_out",
}
# the layer of fairseq's decoders (OPT, XGLM)
FAIRSEQ_LAYER_RENAMES = {
    "self_attn_layer_norm": "input_layernorm",
    "final_layer_norm": "post_attention_layernorm",  # per layer: the norm before the MLP
    "out_proj": "o_proj",
    "fc1": "mlp.up_proj",
    "fc2": "mlp.down_proj",
}
OPT_NAMES = CheckpointNames(
    prefixes={**{f"model.decoder.{k}": v for k, v in _TOP.items()}, **{f"decoder.{k}": v for k, v in _TOP.items()}},
    renames=FAIRSEQ_LAYER_RENAMES,
)
POSITION_OFFSET = 2  # OPT's position table keeps two rows for padding


def opt_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """OPTForCausalLM."""
    bias, affine, pre_norm = bool(hf.enable_bias), bool(hf.layer_norm_elementwise_affine), bool(hf.do_layer_norm_before)
    embedding_dim = hf.word_embed_proj_dim or hf.hidden_size
    return DecoderArchConfig(
        **sizes_of(hf, intermediate_size=hf.ffn_dim),
        layers=layers_of(hf, rope=False),
        norm=NormConfig("layer", 1e-5, bias=affine, has_weight=affine),
        mlp=MLPConfig(hf.activation_function, gated=False, bias=bias),
        qkv_bias=bias,
        o_proj_bias=bias,
        pre_norm=pre_norm,
        norm_after_residual=not pre_norm,
        embedding_dim=None if embedding_dim == hf.hidden_size else embedding_dim,
        absolute_positions="learned",
        position_offset=POSITION_OFFSET,
        max_position=hf.max_position_embeddings,
        final_norm=pre_norm and not hf._remove_final_layer_norm,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class OPTForCausalLM(DecoderForCausalLM):
    """OPT (HF architecture OPTForCausalLM)."""

    arch_config_of = staticmethod(opt_arch_config)
    checkpoint_names = OPT_NAMES
