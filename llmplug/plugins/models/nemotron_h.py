"""NemotronH: every layer is one sublayer behind its own RMSNorm — Mamba 2, attention without rotary,
or a plain squared-ReLU MLP (`layers_block_type`). Checkpoints name the stack `backbone` and every
sublayer `mixer` (and its norm `norm`), so the names are mapped layer by layer."""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig, MLPConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.recurrent import Mamba2MixerConfig
from llmplug.plugins.models.arch_config import refuse, sizes_of

__all__ = ["NemotronHForCausalLM"]

# layers_block_type -> (the layer, the module its `mixer` is here, the module its `norm` is here)
_LAYERS = {
    "linear_attention": (LayerConfig(None, mixer="mamba2", mlp=False), "mixer", "input_layernorm"),
    "full_attention": (LayerConfig(None, mlp=False), "self_attn", "input_layernorm"),
    "mlp": (LayerConfig(None, mixer=None), "mlp", "post_attention_layernorm"),
}


def _check(hf: PretrainedConfig) -> None:
    unknown = set(hf.layers_block_type) - set(_LAYERS)
    refuse(hf, bool(unknown), f"layer types {sorted(unknown)} (MoE layers need the fused MoE layer)")


def nemotron_h_names(hf: PretrainedConfig) -> CheckpointNames:
    """`backbone.layers.i.mixer` / `.norm` -> this layer's sublayer and norm."""
    _check(hf)
    renames = {"embeddings": "embed_tokens", "norm_f": "norm"}
    for i, kind in enumerate(hf.layers_block_type):
        _, module, norm = _LAYERS[kind]
        renames |= {f"layers.{i}.mixer": f"layers.{i}.{module}", f"layers.{i}.norm": f"layers.{i}.{norm}"}
    return CheckpointNames(prefixes={"backbone": "model"}, renames=renames)


def nemotron_h_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """NemotronHForCausalLM with Mamba 2, attention and MLP layers."""
    _check(hf)
    mixer = Mamba2MixerConfig(
        num_heads=hf.mamba_num_heads,
        head_dim=hf.mamba_head_dim,
        state_size=hf.ssm_state_size,
        n_groups=hf.n_groups,
        conv_kernel=hf.conv_kernel,
        chunk_size=hf.chunk_size,
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        activation=hf.mamba_hidden_act,
        time_step_limit=tuple(hf.time_step_limit),
        norm_eps=hf.layer_norm_epsilon,
    )
    bias = bool(hf.attention_bias)
    return DecoderArchConfig(
        **sizes_of(hf),
        layers=tuple(_LAYERS[kind][0] for kind in hf.layers_block_type),
        norm=NormConfig("rms", hf.layer_norm_epsilon),
        mlp=MLPConfig(hf.mlp_hidden_act, gated=False, bias=bool(hf.mlp_bias)),
        qkv_bias=bias,
        o_proj_bias=bias,
        mamba2=mixer,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


class NemotronHForCausalLM(DecoderForCausalLM):
    """Nemotron-H, Nemotron Nano 2 (HF architecture NemotronHForCausalLM)."""

    arch_config_of = staticmethod(nemotron_h_arch_config)
    checkpoint_names_of = staticmethod(nemotron_h_names)
