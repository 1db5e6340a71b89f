"""State-space models without attention: Mamba, FalconMamba, Mamba 2 — the generic decoder with one
recurrent mixer per layer and no MLP.

Each layer is `norm -> mixer -> + residual`; checkpoints name the stack `backbone` with `embeddings`,
a per-layer `norm` and a final `norm_f`. These models have no position limit: pass `max_model_len`.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames
from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig
from llmplug.layers.layernorm import NormConfig
from llmplug.layers.recurrent import Mamba2MixerConfig, MambaMixerConfig
from llmplug.plugins.models.arch_config import architecture_of, refuse

__all__ = ["FalconMambaForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM", "per_layer_renames"]


def per_layer_renames(num_layers: int, source: str, target: str) -> dict[str, str]:
    """`layers.i.<source>` -> `layers.i.<target>` for every layer (a name that means another module elsewhere)."""
    return {f"layers.{i}.{source}": f"layers.{i}.{target}" for i in range(num_layers)}


def _backbone_names(hf: PretrainedConfig) -> CheckpointNames:
    """`backbone.*` with `embeddings`, per-layer `norm` and `norm_f`; the mixer's own names need none."""
    renames = {"embeddings": "embed_tokens", "norm_f": "norm"}
    renames |= per_layer_renames(hf.num_hidden_layers, "norm", "input_layernorm")
    return CheckpointNames(prefixes={"backbone": "model"}, renames=renames)


def _ssm_fields(hf: PretrainedConfig, mixer: str) -> dict:
    """The DecoderArchConfig fields of a model whose every layer is `mixer` alone (no attention, no MLP)."""
    return dict(
        architecture=architecture_of(hf),
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=0,
        num_layers=hf.num_hidden_layers,
        num_heads=0,
        num_kv_heads=0,
        head_dim=0,
        layers=tuple(LayerConfig(None, mixer=mixer, mlp=False) for _ in range(hf.num_hidden_layers)),
        norm=NormConfig("rms", hf.layer_norm_epsilon),
        tie_word_embeddings=bool(hf.tie_word_embeddings),
    )


def mamba_mixer_config(hf: PretrainedConfig, **variant) -> MambaMixerConfig:
    """The mixer of MambaConfig / FalconMambaConfig."""
    return MambaMixerConfig(
        intermediate_size=hf.intermediate_size,
        state_size=hf.state_size,
        conv_kernel=hf.conv_kernel,
        time_step_rank=int(hf.time_step_rank),
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        activation=hf.hidden_act,
        **variant,
    )


def mamba_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """MambaForCausalLM: Mamba mixers, RMSNorm, tied embeddings."""
    return DecoderArchConfig(**_ssm_fields(hf, "mamba"), mamba=mamba_mixer_config(hf))


def falcon_mamba_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """FalconMambaForCausalLM: Mamba with weightless RMS norms of dt, B and C (`mixer_rms_eps`)."""
    mixer = mamba_mixer_config(hf, dt_bc_norm="weightless", dt_bc_norm_eps=hf.mixer_rms_eps)
    return DecoderArchConfig(**_ssm_fields(hf, "mamba"), mamba=mixer)


def mamba2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Mamba2ForCausalLM: Mamba 2 mixers (grouped B/C, gated RMSNorm), RMSNorm."""
    refuse(hf, int(hf.expand * hf.hidden_size) != hf.num_heads * hf.head_dim,
           "expand * hidden_size different from num_heads * head_dim")
    mixer = Mamba2MixerConfig(
        num_heads=hf.num_heads,
        head_dim=hf.head_dim,
        state_size=hf.state_size,
        n_groups=hf.n_groups,
        conv_kernel=hf.conv_kernel,
        chunk_size=hf.chunk_size,
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        activation=hf.hidden_act,
        time_step_limit=tuple(hf.time_step_limit),
        norm_eps=hf.layer_norm_epsilon,
    )
    return DecoderArchConfig(**_ssm_fields(hf, "mamba2"), mamba2=mixer)


class MambaForCausalLM(DecoderForCausalLM):
    """Mamba (HF architecture MambaForCausalLM)."""

    arch_config_of = staticmethod(mamba_arch_config)
    checkpoint_names_of = staticmethod(_backbone_names)


class FalconMambaForCausalLM(DecoderForCausalLM):
    """Falcon Mamba (HF architecture FalconMambaForCausalLM)."""

    arch_config_of = staticmethod(falcon_mamba_arch_config)
    checkpoint_names_of = staticmethod(_backbone_names)


class Mamba2ForCausalLM(DecoderForCausalLM):
    """Mamba 2, Mamba-Codestral (HF architecture Mamba2ForCausalLM)."""

    arch_config_of = staticmethod(mamba2_arch_config)
    checkpoint_names_of = staticmethod(_backbone_names)
