"""Zamba 2: Mamba 2 layers with a few transformer blocks shared across the depth — a model of its own.

Its forward differs from the generic decoder's in ways no layer flag describes: a "hybrid" layer first
runs one of `num_mem_blocks` shared transformer blocks (weights reused cyclically along the depth) on
the concatenation [hidden | the original embeddings] (2 x hidden wide), adds per-use LoRA-like adapters
to the shared projections, projects the block's output with a per-layer `linear`, and feeds that into
its Mamba 2 layer's input (not into the residual stream). Each use of a shared block still owns its
attention KV cache, so the Attention layer (no weights) belongs to the hybrid layer, not to the block.

Built from llmplug.layers blocks (Mamba2Mixer, Attention, RMSNorm, the linear layers, rotary); checkpoint
names are transformers' own, a shared block's weights named at its first use. Tensor parallelism: no.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.core.errors import ModelLoadError
from llmplug.layers.activation import gated_activation
from llmplug.layers.attention import Attention
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.linear import QKVParallelLinear, ReplicatedLinear
from llmplug.layers.recurrent import Mamba2Mixer, Mamba2MixerConfig
from llmplug.layers.rotary import RotaryCosSin, get_rope
from llmplug.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmplug.layers.weight_utils import load_mapped_weights
from llmplug.plugins.models.arch_config import refuse, rope_config_of

__all__ = ["Zamba2ForCausalLM"]

HYBRID = "hybrid"
QKV = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


def _adapter(hf: PretrainedConfig, width_in: int, width_out: int) -> nn.Sequential:
    """A rank-`adapter_rank` update: x -> up(down(x)) (transformers' nn.Sequential names `0`, `1`)."""
    return nn.Sequential(
        ReplicatedLinear(width_in, hf.adapter_rank, False), ReplicatedLinear(hf.adapter_rank, width_out, False)
    )


def _adapters(hf: PretrainedConfig, block_id: int, width_in: int, width_out: int) -> nn.ModuleList:
    """One slot per hybrid layer; the layers that use block `block_id` get an adapter, the others none."""
    uses = range(len(hf.hybrid_layer_ids))
    return nn.ModuleList(
        _adapter(hf, width_in, width_out) if j % hf.num_mem_blocks == block_id else nn.Identity() for j in uses
    )


class SharedAttention(nn.Module):
    """The shared block's attention weights: q/k/v over [hidden | embeddings], o back to hidden."""

    def __init__(self, hf: PretrainedConfig, block_id: int) -> None:
        super().__init__()
        width, self.head_dim = hf.attention_hidden_size, hf.attention_head_dim
        heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(width, self.head_dim, heads, kv_heads, hf.add_bias_linear)
        self.o_proj = ReplicatedLinear(heads * self.head_dim, hf.hidden_size, hf.add_bias_linear)
        self.sizes = [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim]
        self.num_qk_heads = heads + kv_heads
        if hf.use_shared_attention_adapter:
            refuse(hf, kv_heads != heads, "use_shared_attention_adapter with fewer kv heads than heads")
            self.linear_q_adapter_list = _adapters(hf, block_id, width, self.sizes[0])
            self.linear_k_adapter_list = _adapters(hf, block_id, width, self.sizes[1])
            self.linear_v_adapter_list = _adapters(hf, block_id, width, self.sizes[2])
        self.adapted = hf.use_shared_attention_adapter

    def qkv(self, x: torch.Tensor, use: int, rope: RotaryCosSin | None) -> list[torch.Tensor]:
        """x [T, 2 hidden] -> q, k, v [T, heads * head_dim] of hybrid layer `use` (rotated when rope is given)."""
        qkv = self.qkv_proj(x)
        if self.adapted:
            lists = (self.linear_q_adapter_list, self.linear_k_adapter_list, self.linear_v_adapter_list)
            qkv = qkv + torch.cat([adapters[use](x) for adapters in lists], dim=-1)
        if rope is not None:
            rope.apply_(qkv[:, : sum(self.sizes[:2])].view(x.shape[0], self.num_qk_heads, self.head_dim))
        return list(qkv.split(self.sizes, dim=-1))


class SharedMLP(nn.Module):
    """The shared block's gated MLP; each use adds its adapter to the fused [gate | up] projection."""

    def __init__(self, hf: PretrainedConfig, block_id: int) -> None:
        super().__init__()
        inter = hf.intermediate_size
        self.gate_up_proj = ReplicatedLinear(hf.hidden_size, 2 * inter, hf.add_bias_linear)
        self.down_proj = ReplicatedLinear(inter, hf.hidden_size, hf.add_bias_linear)
        self.gate_up_proj_adapter_list = _adapters(hf, block_id, hf.hidden_size, 2 * inter)
        self.act_fn = gated_activation(hf.hidden_act)

    def forward(self, x: torch.Tensor, use: int) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x) + self.gate_up_proj_adapter_list[use](x)))


class SharedTransformer(nn.Module):
    """One of the `num_mem_blocks` shared transformer blocks (weights only: attention runs in the using layer)."""

    def __init__(self, hf: PretrainedConfig, block_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hf.attention_hidden_size, hf.rms_norm_eps)
        self.self_attn = SharedAttention(hf, block_id)
        self.pre_ff_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.feed_forward = SharedMLP(hf, block_id)


class MambaLayer(nn.Module):
    """x + mamba(norm(x + t)): t is the shared block's contribution (hybrid layers), not added to the stream."""

    def __init__(self, hf: PretrainedConfig, mixer: Mamba2MixerConfig, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.mamba = Mamba2Mixer(mixer, hf.hidden_size, f"{prefix}.mamba")

    def forward(self, hidden: torch.Tensor, transformer_out: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden if transformer_out is None else hidden + transformer_out
        return hidden + self.mamba(self.input_layernorm(x))


class HybridLayer(nn.Module):
    """A shared transformer block (its `use`-th use), its own attention cache and `linear`, then a Mamba layer."""

    def __init__(self, hf: PretrainedConfig, block: SharedTransformer, use: int, mixer: Mamba2MixerConfig, prefix: str):
        super().__init__()
        self.shared_transformer, self.use = block, use
        attention = block.self_attn
        self.attn = Attention(
            hf.num_attention_heads,
            attention.head_dim,
            (attention.head_dim / 2) ** -0.5,  # Zamba's scale: the head dim counts the concatenated halves
            hf.num_key_value_heads,
            prefix=f"{prefix}.attn",
        )
        self.linear = ReplicatedLinear(hf.hidden_size, hf.hidden_size, False)
        self.mamba_decoder = MambaLayer(hf, mixer, f"{prefix}.mamba_decoder")

    def forward(self, hidden: torch.Tensor, embeddings: torch.Tensor, rope: RotaryCosSin | None) -> torch.Tensor:
        block = self.shared_transformer
        x = block.input_layernorm(torch.cat([hidden, embeddings], dim=-1))  # [T, 2 hidden]
        out = block.self_attn.o_proj(self.attn(*block.self_attn.qkv(x, self.use, rope)))
        out = block.feed_forward(block.pre_ff_layernorm(out), self.use)
        return self.mamba_decoder(hidden, self.linear(out))


def zamba2_mixer_config(hf: PretrainedConfig) -> Mamba2MixerConfig:
    """Zamba 2's Mamba 2: conv bias always, gated-norm eps 1e-5, dt clamped below at time_step_min."""
    refuse(hf, int(hf.mamba_expand * hf.hidden_size) != hf.n_mamba_heads * hf.mamba_headdim,
           "mamba_expand * hidden_size different from n_mamba_heads * mamba_headdim")
    return Mamba2MixerConfig(
        num_heads=hf.n_mamba_heads,
        head_dim=hf.mamba_headdim,
        state_size=hf.mamba_d_state,
        n_groups=hf.mamba_ngroups,
        conv_kernel=hf.mamba_d_conv,
        chunk_size=hf.chunk_size,
        conv_bias=True,
        proj_bias=bool(hf.add_bias_linear),
        time_step_limit=(hf.time_step_min, float("inf")),
        norm_eps=1e-5,
    )


class Zamba2Model(nn.Module):
    """Embeddings, the Mamba and hybrid layers, the final norm."""

    def __init__(self, hf: PretrainedConfig) -> None:
        super().__init__()
        mixer = zamba2_mixer_config(hf)
        self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size)
        blocks = [SharedTransformer(hf, b) for b in range(hf.num_mem_blocks)]
        layers, uses = [], 0
        for i, kind in enumerate(hf.layers_block_type):
            prefix = f"model.layers.{i}"
            if kind == HYBRID:
                layers.append(HybridLayer(hf, blocks[uses % hf.num_mem_blocks], uses, mixer, prefix))
                uses += 1
            else:
                layers.append(MambaLayer(hf, mixer, prefix))
        self.layers = nn.ModuleList(layers)  # a shared block's parameters are named at its first use
        self.final_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.rotary = None
        if hf.use_mem_rope:
            rope = rope_config_of(hf)
            dim = hf.attention_head_dim
            self.rotary = get_rope(dim, dim, rope.max_position, rope.theta, rope.scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = embeddings = self.embed_tokens(input_ids)  # [T, hidden]
        rope = None if self.rotary is None else self.rotary.cos_sin(positions, hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, embeddings, rope) if isinstance(layer, HybridLayer) else layer(hidden)
        return self.final_layernorm(hidden)


class Zamba2ForCausalLM(nn.Module):
    """Zamba 2 (HF architecture Zamba2ForCausalLM)."""

    supports_tensor_parallel = False
    supports_pipeline_parallel = False

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__()
        if get_tp_group().world_size > 1:
            raise ModelLoadError("Zamba2ForCausalLM runs without tensor parallelism: set tensor_parallel_size=1")
        self.config = config
        self.model = Zamba2Model(config)
        self.tied = bool(config.tie_word_embeddings)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tied:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: object = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head.get_logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """transformers' names; q/k/v into the fused qkv_proj."""
        return load_mapped_weights(self, weights, QKV, skipped_names=("lm_head.weight",) if self.tied else ())
