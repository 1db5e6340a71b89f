"""The typed, frozen description of a transformer that `DecoderForCausalLM` (or, for embeddings and
classifiers, `TransformerForPooling`) builds.

A family's config adapter (llmplug/plugins/models/) reads its HF config once into a
`DecoderArchConfig`; the generic decoder reads nothing else. Every field defaults to the Llama
choice, so an adapter names only what its family changes. An encoder (BERT, ModernBERT) is the same
transformer with `causal=False`, and BERT's norms after each residual add are `norm_after_residual`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping

from llmplug.layers.layernorm import NormConfig
from llmplug.layers.qk_norm import QKNormConfig
from llmplug.layers.recurrent.gated_delta_net import GatedDeltaNetConfig
from llmplug.layers.recurrent.mamba import MambaMixerConfig
from llmplug.layers.recurrent.mamba2 import Mamba2MixerConfig
from llmplug.layers.recurrent.short_conv import ShortConvConfig

if TYPE_CHECKING:  # the MoE block builds its shared experts from this package's MLP
    from llmplug.layers.moe.config import MoEConfig, RouterConfig

__all__ = [
    "RECURRENT_MIXERS",
    "DecoderArchConfig",
    "HeadTransformConfig",
    "LayerConfig",
    "MLAConfig",
    "MLPConfig",
    "MixerKind",
    "RopeConfig",
]

# the token mixer of a layer: attention, or a recurrent mixer of llmplug.layers.recurrent
MixerKind = Literal["attention", "mamba", "mamba2", "gated_delta_net", "short_conv"]
# the recurrent mixer kinds; each is also the DecoderArchConfig field holding that mixer's config
RECURRENT_MIXERS = frozenset({"mamba", "mamba2", "gated_delta_net", "short_conv"})


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding of a layer."""

    theta: float
    max_position: int  # max_position_embeddings of the config
    scaling: Mapping[str, Any] | None = None  # rope_scaling / rope_parameters without rope_theta; None: plain RoPE
    partial_rotary_factor: float = 1.0  # share of each head's leading dims that are rotated
    is_neox_style: bool = True  # rotate-half pairs (i, i + d/2); False: interleaved pairs (2i, 2i + 1), GPT-J style
    inverted: bool = False  # rotate by minus the angle (NanoChat's flipped rotate_half)
    # multimodal RoPE (layers/mrope.py): frequencies per position stream (t, h, w); positions then come as [3, T]
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL's layout of the streams over the frequencies (layers/mrope.py)


@dataclass(frozen=True, slots=True)
class LayerConfig:
    """What may differ from one layer to the next."""

    rope: RopeConfig | None  # None: no rotary embedding in this layer (NoPE)
    sliding_window: int | None = None  # None: attends to the whole context (bidirectional: keys |i - j| < W)
    attention_chunk: int | None = None  # chunked local attention: keys of the query's own chunk of C positions
    qk_norm: bool = True  # False: this layer skips the arch's q/k norm (Llama 4's NoPE layers)
    query_scale: bool = True  # False: this layer's queries skip the arch's query_position_scale (Llama 4)
    mixer: MixerKind | None = "attention"  # None: no token mixer (NemotronH's MLP-only layers)
    # a recurrent mixer run beside the attention on the same input, the outputs summed (Falcon-H1)
    parallel_mixer: MixerKind | None = None
    mlp: bool = True  # False: the layer is its mixer alone (Mamba, NemotronH's mixer layers)
    o_proj_bias: bool = False  # a bias on this layer's output projection alone (GPT-NeoX-Japanese: the last layer)
    input_norm: bool = True  # False: no norm before this layer's attention (ModernBERT's first layer)
    moe: bool = False  # the MLP is the arch's mixture of experts (DecoderArchConfig.moe), else the dense one
    # this attention + MLP layer is post-norm (OLMo 2's placement) in a pre-norm model (OLMo hybrid)
    post_norm: bool = False
    # features the attention's q/k/v projection reads; None: hidden_size (EAGLE-3's head reads [embedding | hidden])
    attention_input_size: int | None = None


@dataclass(frozen=True, slots=True)
class MLPConfig:
    """The feed-forward block: down(act(gate(x)) * up(x)) when gated, else down(act(up(x)))."""

    activation: str = "silu"  # a name of llmplug.layers.activation.ACTIVATIONS, or "xielu"
    gated: bool = True
    bias: bool = False
    down_bias: bool | None = None  # None: as `bias` (GTE: only down_proj has one)
    gate_multiplier: float = 1.0  # act(gate(x) * m) * up(x) (Falcon-H1's muP)
    down_multiplier: float = 1.0  # down(...) * m (Falcon-H1's muP)


@dataclass(frozen=True, slots=True)
class HeadTransformConfig:
    """dense -> activation -> norm between the final norm and the LM head (ModernBERT's prediction head)."""

    activation: str  # a name of llmplug.layers.activation.ACTIVATIONS
    bias: bool = False  # on the dense layer


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
    mla: MLAConfig | None = None  # multi-head latent attention instead of q/k/v projections (DeepSeek V2/V3)
    # mixture of attention: per token, the router's top_k of num_experts (query, output) projection pairs
    # over shared k/v, num_kv_heads query heads each (JetMoe; o_proj_bias: a bias after the experts' sum)
    attention_experts: RouterConfig | None = None
    clip_qkv: float | None = None  # q, k, v clamped to [-clip_qkv, clip_qkv] (OLMo, MPT)
    # (beta, length): after rotary, q at position p times 1 + beta * log(1 + floor(p / length)) (Ministral 3)
    query_position_scale: tuple[float, int] | None = None
    query_scale_offset: int = 0  # the scale's positions count from this (Llama 4: floor((p + 1) / length))
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    alibi: bool = False  # ALiBi biases instead of positions (Bloom, MPT, Falcon-RW)
    alibi_max_bias: float = 8.0
    alibi_scaled: bool = False  # the bias is multiplied by the attention scale too (Falcon)
    attention_sinks: bool = False  # a learned per-head sink logit
    causal: bool = True  # False: every token attends to the whole prompt (encoders; no KV cache, never chunked)
    attention_output_gate: bool = False  # q_proj also gives a gate per head: out * sigmoid(gate) (Qwen3-Next)
    key_multiplier: float = 1.0  # k scaled before rotary (Falcon-H1)
    # a layer with a parallel mixer: attn(x * in) * out + mixer(x) * mixer_out (Falcon-H1's muP)
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    parallel_mixer_out_multiplier: float = 1.0

    # recurrent mixers (llmplug.layers.recurrent), one config each for the layers whose `mixer` names it
    mamba: MambaMixerConfig | None = None
    mamba2: Mamba2MixerConfig | None = None
    gated_delta_net: GatedDeltaNetConfig | None = None
    short_conv: ShortConvConfig | None = None

    # layer structure
    pre_norm: bool = True  # norm before each sublayer (input_layernorm, post_attention_layernorm)
    post_norm: bool = False  # norm of each sublayer's output before the residual add (OLMo 2; with pre: Gemma 2)
    norm_after_residual: bool = False  # x = norm(x + sublayer(x)), no pre-norm (post-LN: GPT-1, OPT-350m, BERT)
    parallel_residual: bool = False  # x + attn(norm(x)) + mlp(norm'(x)) (GPT-J, GPT-NeoX, Falcon, Phi, Cohere)
    parallel_mlp_norm: bool = False  # with parallel_residual: the MLP has its own norm' (GPT-NeoX, Falcon-40B)
    residual_multiplier: float = 1.0  # sublayer outputs scaled before the residual add (Granite)

    # embeddings and positions
    embedding_multiplier: float = 1.0  # token embeddings scaled (Gemma: sqrt(hidden), Granite)
    # the multiplier is part of the token embedding (transformers' embedding module scales: Gemma, BioGPT), so
    # embeddings given in place of tokens (prompt_embeds) arrive scaled; False: the forward scales them (Granite)
    embedding_multiplier_in_table: bool = False
    embedding_norm: bool = False  # a norm right after the embeddings (Bloom)
    embedding_dim: int | None = None  # token embeddings (and LM head) of another width, projected in/out (OPT-350m)
    # added to the token embeddings; sinusoidal: XGLM's table, sinusoidal_paper: the Transformer paper's (CTRL)
    absolute_positions: Literal["learned", "sinusoidal", "sinusoidal_paper"] | None = None
    position_offset: int = 0  # row of position p in the position table is p + offset (OPT, XGLM: 2)
    max_position: int = 0  # rows of the position table (without the offset)
    type_vocab_size: int = 0  # token-type (segment) embeddings added to the token embeddings (BERT); 0: none

    # output
    final_norm: bool = True  # False: the last layer's output goes to the head as it is (post-LN models)
    head_transform: HeadTransformConfig | None = None  # dense, activation and norm before the LM head
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
        if self.norm_after_residual and (self.pre_norm or self.post_norm or self.parallel_residual):
            raise ValueError(f"{self.architecture}: norm_after_residual replaces pre_norm, post_norm and parallel_residual")
        if not (self.pre_norm or self.post_norm or self.norm_after_residual):
            raise ValueError(f"{self.architecture}: a layer needs pre_norm, post_norm, both, or norm_after_residual")
        if any(layer.moe for layer in self.layers) and self.moe is None:
            raise ValueError(f"{self.architecture}: layers marked moe need a MoEConfig (DecoderArchConfig.moe)")
        if self.absolute_positions and self.max_position <= 0:
            raise ValueError(f"{self.architecture}: absolute positions need max_position > 0")
        if self.mlp.gate_multiplier != 1.0 and not self.mlp.gated:
            raise ValueError(f"{self.architecture}: an MLP gate multiplier needs a gated MLP")
        self._check_layer_kinds()

    def _check_layer_kinds(self) -> None:
        """Each recurrent mixer has its config; layers other than attention + MLP are plain pre-norm."""
        for i, layer in enumerate(self.layers):
            for kind in (layer.mixer, layer.parallel_mixer):
                if kind in RECURRENT_MIXERS and getattr(self, kind) is None:
                    raise ValueError(f"{self.architecture}: layer {i} has a {kind} mixer but `{kind}` is None")
            beside_attention = layer.mixer == "attention" and layer.parallel_mixer in RECURRENT_MIXERS
            if layer.parallel_mixer is not None and not beside_attention:
                raise ValueError(f"{self.architecture}: layer {i}: a parallel mixer is recurrent, beside attention")
            if layer.mixer is None and not layer.mlp:
                raise ValueError(f"{self.architecture}: layer {i} has neither a mixer nor an MLP")
            plain_layer = layer.mixer == "attention" and layer.mlp and layer.parallel_mixer is None
            if layer.post_norm and not (plain_layer and self.pre_norm and not self.post_norm):
                raise ValueError(
                    f"{self.architecture}: layer {i}: a post-norm layer is attention + MLP in a pre-norm model"
                )
        plain = all(layer.mixer == "attention" and layer.mlp for layer in self.layers)
        if not plain and (self.post_norm or self.parallel_residual or not self.pre_norm):
            raise ValueError(
                f"{self.architecture}: layers with a recurrent mixer or a single sublayer are pre-norm only "
                "(no post_norm, no parallel_residual)"
            )

    @property
    def has_recurrent_layers(self) -> bool:
        """Whether any layer's mixer keeps per-request state."""
        return any({layer.mixer, layer.parallel_mixer} & RECURRENT_MIXERS for layer in self.layers)

    @property
    def scale(self) -> float:
        """The attention scale (softmax temperature)."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def rotary_dim(self, rope: RopeConfig) -> int:
        """Leading dims of each head that `rope` rotates."""
        return int(self.head_dim * rope.partial_rotary_factor)
