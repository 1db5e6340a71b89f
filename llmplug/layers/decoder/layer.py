"""One layer of the generic decoder: attention and MLP, their norms, and the residual stream.

The residual stream is carried as a pair (sublayer output, residual): the sum is only formed by
the next norm, fused with it (`norm(x, residual)`), so a pre-norm layer does no separate add.

A layer's token mixer (`LayerConfig.mixer`) is attention (`self_attn`) or a recurrent mixer of
llmplug.layers.recurrent (`mixer`: Mamba, Mamba 2, gated delta net, short conv); a layer may also
lack its mixer or its MLP (`LayerConfig.mlp`): such layers are pre-norm, with `input_layernorm`
before the mixer and `post_attention_layernorm` before the MLP.

Norm placement, with transformers' module names (so most checkpoints need no renames):

| layout                  | before attn     | after attn  | before MLP                | after MLP   |
|-------------------------|-----------------|-------------|---------------------------|-------------|
| pre_norm (Llama)        | input_layernorm |             | post_attention_layernorm  |             |
| pre + post (Gemma 2)    | input_layernorm | post_attn * | pre_feedforward_layernorm | post_ffn ** |
| post_norm (OLMo 2)      |                 | post_attn * |                           | post_ffn ** |
| parallel_residual       | input_layernorm, also the MLP's unless parallel_mlp_norm: post_attention_layernorm |
| norm_after_residual     | x = input_layernorm(x + attn(x)); x = post_attention_layernorm(x + mlp(x))  |

(* post_attention_layernorm, ** post_feedforward_layernorm)

A layer with `LayerConfig.post_norm` is post_norm in an otherwise pre_norm model (OLMo hybrid).

A norm_after_residual (post-LN) layer ends on a norm of the whole stream, so it returns (stream, None):
the residual None means "nothing to add", as at the first layer.
"""

from __future__ import annotations

import torch
from torch import nn

from llmplug.communicators.parallel_state import get_tp_group
from llmplug.layers.decoder.arch import DecoderArchConfig, LayerConfig, MixerKind
from llmplug.layers.decoder.attention import DecoderAttention
from llmplug.layers.decoder.mixture_of_attention import MixtureOfAttention
from llmplug.layers.decoder.mla import LatentAttention
from llmplug.layers.decoder.mlp import DecoderMLP
from llmplug.layers.layernorm import LayerNorm, RMSNorm, make_norm
from llmplug.layers.recurrent import GatedDeltaNet, Mamba2Mixer, MambaMixer, RecurrentMixer, ShortConv
from llmplug.layers.rotary import RotaryCosSin

__all__ = ["DecoderLayer"]

Norm = RMSNorm | LayerNorm
RECURRENT_MIXER_CLASSES: dict[str, type[RecurrentMixer]] = {
    "mamba": MambaMixer,
    "mamba2": Mamba2Mixer,
    "gated_delta_net": GatedDeltaNet,
    "short_conv": ShortConv,
}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class DecoderLayer(nn.Module):
    """x -> x + attn(...) -> + mlp(...), or x + attn(norm(x)) + mlp(norm'(x)) with a parallel residual."""

    def __init__(self, arch: DecoderArchConfig, layer: LayerConfig, prefix: str = "") -> None:
        super().__init__()
        self.parallel = arch.parallel_residual
        reduce = not self.parallel  # a parallel layer sums attention and MLP, then all-reduces once
        self.mixer_kind: MixerKind | None = layer.mixer
        self.parallel_mixer = layer.parallel_mixer is not None
        if layer.mixer == "attention":
            self.self_attn = _attention(arch, layer, _join(prefix, "self_attn"), reduce)
        recurrent = layer.parallel_mixer or (layer.mixer if layer.mixer != "attention" else None)
        if recurrent is not None:
            mixer_cls = RECURRENT_MIXER_CLASSES[recurrent]
            self.mixer = mixer_cls(getattr(arch, recurrent), arch.hidden_size, _join(prefix, "mixer"))
        self.multipliers = (  # of a layer with a parallel mixer: attention in, attention out, mixer out
            arch.attention_in_multiplier,
            arch.attention_out_multiplier,
            arch.parallel_mixer_out_multiplier,
        )
        self.mlp = _mlp(arch, layer, _join(prefix, "mlp"), reduce) if layer.mlp else None
        pre, post = (False, True) if layer.post_norm else (arch.pre_norm, arch.post_norm)
        self.residual_multiplier, self.post_norm = arch.residual_multiplier, post
        norm = lambda: make_norm(arch.norm, arch.hidden_size)  # noqa: E731
        self.norm_after_residual = arch.norm_after_residual
        self.input_layernorm: Norm | None = (
            norm() if (pre and layer.input_norm and layer.mixer is not None) or self.norm_after_residual else None
        )
        self.post_attention_layernorm: Norm | None = (
            norm() if layer.mlp and (post or not self.parallel or arch.parallel_mlp_norm) else None
        )
        self.pre_feedforward_layernorm: Norm | None = norm() if (pre and post) else None
        self.post_feedforward_layernorm: Norm | None = norm() if post else None

    # transformers' names mean different places in different layouts (see the module doc)
    @property
    def attn_out_norm(self) -> Norm | None:
        """The norm of the attention output, if any."""
        return self.post_attention_layernorm if self.post_norm else None

    @property
    def mlp_in_norm(self) -> Norm | None:
        """The norm of the MLP input, if the MLP has its own."""
        return self.pre_feedforward_layernorm if self.post_norm else self.post_attention_layernorm

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryCosSin | None,
        query_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(sublayer output, residual stream) of the previous layer -> the same for this one (residual None:
        `hidden` is the stream itself, as the embedding output at the first layer)."""
        if self.parallel:
            return self._parallel(hidden, residual, rope, query_scale)
        if self.norm_after_residual:
            return self._norm_after_residual(hidden, residual, rope, query_scale)
        if self.mixer_kind is not None:
            hidden, residual = _add_and_norm(self.input_layernorm, hidden, residual)
            hidden = self._scaled(_norm(self.attn_out_norm, self._mix(hidden, rope, query_scale)))
        if self.mlp is not None:
            hidden, residual = _add_and_norm(self.mlp_in_norm, hidden, residual)
            hidden = self._scaled(_norm(self.post_feedforward_layernorm, self.mlp(hidden)))
        return hidden, residual

    def _mix(self, hidden: torch.Tensor, rope: RotaryCosSin | None, query_scale: torch.Tensor | None) -> torch.Tensor:
        """The token mixer: attention (with this layer's rope) or a recurrent mixer, or both side by side."""
        if self.parallel_mixer:
            attn_in, attn_out, mixer_out = self.multipliers
            attention = self.self_attn(hidden * attn_in if attn_in != 1.0 else hidden, rope, query_scale)
            return attention.mul_(attn_out).add_(self.mixer(hidden), alpha=mixer_out)
        return self.self_attn(hidden, rope, query_scale) if self.mixer_kind == "attention" else self.mixer(hidden)

    def _norm_after_residual(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryCosSin | None,
        query_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        """norm'(y + mlp(y)) with y = norm(x + attn(x)): the stream, normalized (post-LN)."""
        stream = _add_and_norm(None, hidden, residual)[0]
        attn_out = self._scaled(self.self_attn(stream, rope, query_scale))
        normed = self.input_layernorm(attn_out, stream)[0]
        return self.post_attention_layernorm(self._scaled(self.mlp(normed)), normed)[0], None

    def _parallel(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryCosSin | None,
        query_scale: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x + attn(norm(x)) + mlp(norm(x) or norm'(x)), the two outputs summed over the ranks at once."""
        normed, residual = _add_and_norm(self.input_layernorm, hidden, residual)
        mlp_in = normed if self.mlp_in_norm is None else self.mlp_in_norm(residual)
        out = self.self_attn(normed, rope, query_scale).add_(self.mlp(mlp_in))  # this rank's partial sums
        tp = get_tp_group()
        return self._scaled(tp.all_reduce(out) if tp.world_size > 1 else out), residual

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """A sublayer's output times the residual multiplier (in place: it is a fresh tensor)."""
        return out.mul_(self.residual_multiplier) if self.residual_multiplier != 1.0 else out


def _attention(arch: DecoderArchConfig, layer: LayerConfig, prefix: str, reduce: bool) -> nn.Module:
    """The layer's attention: multi-head latent attention when the arch has an MLAConfig, a mixture of attention
    with `attention_experts`, else q/k/v heads."""
    if arch.mla is not None:
        return LatentAttention(arch, prefix, reduce_results=reduce)
    if arch.attention_experts is not None:
        return MixtureOfAttention(arch, prefix, reduce_results=reduce)
    return DecoderAttention(arch, layer, prefix, reduce_results=reduce)


def _mlp(arch: DecoderArchConfig, layer: LayerConfig, prefix: str, reduce: bool) -> nn.Module:
    """The layer's MLP: the mixture of experts on layers marked `moe`, else the dense one."""
    if not layer.moe:
        return DecoderMLP(arch.mlp, arch.hidden_size, arch.intermediate_size, prefix, reduce)
    from llmplug.layers.moe import SparseMoeBlock  # imported here: the MoE block builds on this package's MLP

    return SparseMoeBlock(arch.moe, arch.hidden_size, prefix, reduce)


def _add_and_norm(
    norm: Norm | None, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(hidden + residual), hidden + residual); without a norm (post-norm layers) the sum twice."""
    if residual is None:  # the first layer: hidden is the stream itself
        return (hidden if norm is None else norm(hidden)), hidden
    if norm is None:
        stream = hidden.add_(residual)
        return stream, stream
    return norm(hidden, residual)


def _norm(norm: Norm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)
