"""The typed, frozen description of a decoder-only transformer that `DecoderForCausalLM` builds.

A family's config adapter (llmplug/plugins/models/) reads its HF config once into a
`DecoderArchConfig`; the generic decoder reads nothing else. Every field defaults to the Llama
choice, so an adapter names only what its family changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping

from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig

if TYPE_CHECKING:  # the MoE block builds its shared experts from this package's MLP
    from llmplug.layers.moe.config import MoEConfig

__all__ = ["DecoderArchConfig", "LayerConfig", "MLAConfig", "MLPConfig", "RopeConfig"]


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of a layer."""

    theta: float
    max_position: int  # max_position_embeddings of the config
    scaling: Mapping[str, Any] | None = None  # rope_scaling / rope_parameters without rope_theta; None: plain RoPE
    partial_rotary_factor: float = 1.0  # share of each head's leading dims that are rotated
    is_neox_style: bool = True  # rotate-half pairs (i, i + d/2); False: interleaved pairs (2i, 2i + 1), GPT-J style


@dataclass(frozen=True, slots=True)
class LayerConfig:
    """What may differ from one layer to the next."""

    rope: RopeConfig | None  # None: no rotary embedding in this layer (NoPE)
    sliding_window: int | None = None  # None: attends to the whole context
    moe: bool = False  # the MLP is the arch's mixture of experts (DecoderArchConfig.moe), else the dense one


@dataclass(frozen=True, slots=True)
class MLPConfig:
    """The feed-forward block: down(act(gate(x)) * up(x)) when gated, else down(act(up(x)))."""

    activation: str = "silu"  # a name of llmplug.layers.activation.ACTIVATIONS, or "xielu"
    gated: bool = True
    bias: bool = False


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek V2/V3): keys and values come from one compressed latent per token.

    q = q_proj(x), or q_b_proj(norm(q_a_proj(x))) with a `q_lora_rank`; each head is [nope | rope] dims.
    kv_a_proj_with_mqa(x) = [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]; c_kv is normalized, k_pe
    rotated (one for all heads); kv_b_proj(c_kv) expands to each head's [k_nope | v]. The KV cache holds
    [c_kv | k_pe] only; the rotary of the arch (its `head_dim` is qk_rope_head_dim) rotates q_pe, k_pe.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q projected directly
    latent_norm_eps: float = 1e-6  # of q_a_layernorm and kv_a_layernorm
    latent_bias: bool = False  # q_a_proj and kv_a_proj_with_mqa have a bias (DeepSeek V2's attention_bias)

    @property
    def qk_head_dim(self) -> int:
        """Dims of each head's query (and expanded key): nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class DecoderArchConfig:
    """A decoder-only transformer: sizes, blocks and their placement, positions, multipliers."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerConfig, ...]  # one per layer: rotary and attention window
    norm: NormConfig = NormConfig()  # every norm of the model (the q/k norms have their own)
    mlp: MLPConfig = MLPConfig()  # the dense MLP (of `intermediate_size`)
    moe: MoEConfig | None = None  # the mixture-of-experts MLP of the layers marked `moe`

    # attention
    qkv_bias: bool = False  # bias on q, k, v projections
    o_proj_bias: bool = False
    qk_norm: QKNormConfig | None = None  # norm of q and k before rotary
    qk_norm_after_rope: bool = False  # the q/k norm follows the rotary instead (HunYuan)
    mla: MLAConfig | None = None  # multi-head latent attention instead of q/k/v projections (DeepSeek V2/V3)
    clip_qkv: float | None = None  # q, k, v clamped to [-clip_qkv, clip_qkv] (OLMo, MPT)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    alibi: bool = False  # ALiBi biases instead of positions (Bloom, MPT, Falcon-RW)
    alibi_max_bias: float = 8.0
    alibi_scaled: bool = False  # the bias is multiplied by the attention scale too (Falcon)
    attention_sinks: bool = False  # a learned per-head sink logit

    # layer structure
    pre_norm: bool = True  # norm before each sublayer (input_layernorm, post_attention_layernorm)
    post_norm: bool = False  # norm of each sublayer's output before the residual add (OLMo 2; with pre: Gemma 2)
    parallel_residual: bool = False  # x + attn(norm(x)) + mlp(norm'(x)) (GPT-J, GPT-NeoX, Falcon, Phi, Cohere)
    parallel_mlp_norm: bool = False  # with parallel_residual: the MLP has its own norm' (GPT-NeoX, Falcon-40B)
    residual_multiplier: float = 1.0  # sublayer outputs scaled before the residual add (Granite)

    # embeddings and positions
    embedding_multiplier: float = 1.0  # token embeddings scaled (Gemma: sqrt(hidden), Granite)
    embedding_norm: bool = False  # a norm right after the embeddings (Bloom)
    absolute_positions: Literal["learned", "sinusoidal"] | None = None  # added to the token embeddings
    position_offset: int = 0  # row of position p in the position table is p + offset (OPT, XGLM: 2)
    max_position: int = 0  # rows of the position table (without the offset)

    # output
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    logits_multiplier: float = 1.0  # logits scaled (Cohere's logit_scale, 1 / Granite's logits_scaling)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)

    def __post_init__(self) -> None:
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{self.architecture}: {len(self.layers)} layer configs for {self.num_layers} layers")
        if self.parallel_mlp_norm and not self.parallel_residual:
            raise ValueError(f"{self.architecture}: parallel_mlp_norm needs parallel_residual")
        if self.parallel_residual and self.post_norm:
            raise ValueError(f"{self.architecture}: a parallel residual with post-sublayer norms is not modelled")
        if not (self.pre_norm or self.post_norm):
            raise ValueError(f"{self.architecture}: a layer needs pre_norm, post_norm or both")
        if any(layer.moe for layer in self.layers) and self.moe is None:
            raise ValueError(f"{self.architecture}: layers marked moe need a MoEConfig (DecoderArchConfig.moe)")
        if self.absolute_positions and self.max_position <= 0:
            raise ValueError(f"{self.architecture}: absolute positions need max_position > 0")

    @property
    def scale(self) -> float:
        """The attention scale (softmax temperature)."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def rotary_dim(self, rope: RopeConfig) -> int:
        """Leading dims of each head that `rope` rotates."""
        return int(self.head_dim * rope.partial_rotary_factor)
