"""Whisper's audio encoder: log-mel frames in, one hidden state per 20 ms out.

mel [B, n_mels, frames] -> conv1d (k 3) + GELU -> conv1d (k 3, stride 2) + GELU -> plus learned positions
(initialised sinusoidal, stored in the checkpoint) -> pre-LN transformer layers -> a final LayerNorm. The layers
are the ViT's (`llmplug.layers.vision.vit.VisionEncoderLayer`: bidirectional attention, a two-layer MLP, each with
its LayerNorm before it), built from a `ViTConfig` view of the Whisper shape; Whisper's `k_proj` has no bias, so
its share of the fused q/k/v bias is loaded as zeros (as vLLM does). Under tensor parallelism the layers shard as
the ViT's (each rank its share of the heads and of the MLP's hidden units); the convolutions, positions and final
norm are replicated, so every rank encodes whole windows.

Whisper, Qwen2-Audio's tower and other Whisper-derived encoders differ only by data (`WhisperEncoderConfig`).
A checkpoint's frames are padded to the trained window (`max_source_positions` * 2 frames, 30 s); a shorter input
takes the first positions (transformers refuses it: the caller decides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames, HeadLayout
from llmplug.layers.layernorm import LayerNorm
from llmplug.layers.vision.vit import ViTConfig, ViTLayout, VisionEncoderLayer
from llmplug.layers.weight_utils import StackedParamsMap, default_weight_loader, load_mapped_weights

__all__ = ["WhisperEncoder", "WhisperEncoderConfig", "whisper_encoder_config", "with_zero_k_bias"]

STACKED: StackedParamsMap = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
# transformers' WhisperEncoder names -> ours (the ViT layer's); a full model's `model.encoder.` is the caller's
CHECKPOINT_NAMES = CheckpointNames(
    renames={
        "self_attn_layer_norm": "layer_norm1",
        "final_layer_norm": "layer_norm2",
        "fc1": "mlp.up_proj",
        "fc2": "mlp.down_proj",
    },
)
# the ViT layer's flags that a Whisper layer has: no layer scale (the rest describe a ViT's embeddings, unused)
_LAYER_LAYOUT = ViTLayout(class_token=False, patch_bias=True, pre_norm=False, post_norm="tokens")


@dataclass(frozen=True, slots=True)
class WhisperEncoderConfig:
    """A Whisper encoder's shape, read once from a WhisperConfig (or Qwen2-Audio's `audio_config`)."""

    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    max_source_positions: int  # encoder states per window (1500: 30 s at 20 ms)
    activation: str  # a name of llmplug.layers.activation.ACTIVATIONS ("gelu")
    eps: float = 1e-5  # transformers' WhisperEncoderLayer norms use nn.LayerNorm's default
    pool_stride: int = 1  # > 1: states average-pooled by it before the final norm (Qwen2-Audio's avg_pooler: 2)

    @property
    def max_frames(self) -> int:
        """Mel frames of one window (the stride-2 conv halves them)."""
        return 2 * self.max_source_positions

    def layer_config(self) -> ViTConfig:
        """The ViT layer's view of this shape (its image fields describe one window's frames)."""
        return ViTConfig(
            layout=_LAYER_LAYOUT, hidden_size=self.d_model, intermediate_size=self.ffn_dim, num_layers=self.num_layers,
            num_heads=self.num_heads, image_size=self.max_frames, patch_size=2, num_channels=self.num_mel_bins,
            activation=self.activation, eps=self.eps,
        )


def whisper_encoder_config(hf: PretrainedConfig) -> WhisperEncoderConfig:
    """The encoder shape of a WhisperConfig or a Qwen2AudioEncoderConfig."""
    return WhisperEncoderConfig(
        num_mel_bins=hf.num_mel_bins,
        d_model=hf.d_model,
        num_layers=hf.encoder_layers,
        num_heads=hf.encoder_attention_heads,
        ffn_dim=hf.encoder_ffn_dim,
        max_source_positions=hf.max_source_positions,
        activation=hf.activation_function,
    )


def _frozen(module: nn.Module) -> nn.Module:
    for param in module.parameters():
        param.requires_grad_(False)
        param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return module


class WhisperEncoder(nn.Module):
    """input_features [B, n_mels, frames] -> [B, frames / 2, d_model] (transformers' `last_hidden_state`)."""

    def __init__(self, config: WhisperEncoderConfig, prefix: str = "") -> None:
        super().__init__()
        c = config
        self.config = c
        self.conv1 = _frozen(nn.Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1))
        self.conv2 = _frozen(nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1))
        self.embed_positions = _frozen(nn.Embedding(c.max_source_positions, c.d_model))
        layer = c.layer_config()
        join = f"{prefix}." if prefix else ""
        self.layers = nn.ModuleList(VisionEncoderLayer(layer, f"{join}layers.{i}") for i in range(c.num_layers))
        self.layer_norm = LayerNorm(c.d_model, c.eps)

    def forward(self, input_features: torch.Tensor, num_positions: int | None = None) -> torch.Tensor:
        """[B, n_mels, frames <= max_frames] -> [B, ceil(frames / 2) // pool_stride, d_model]. `num_positions`: keep
        only the first states after the convolutions (a padded window's valid ones, as transformers' attention mask
        over the padding leaves them), so the layers never see the padding: [B, num_positions // pool_stride,
        d_model]."""
        frames = input_features.shape[-1]
        if frames > self.config.max_frames:
            raise ValueError(f"{frames} mel frames exceed the encoder's window of {self.config.max_frames}")
        if num_positions is not None:  # the convolutions of position p read frames up to 2p + 1
            input_features = input_features[..., : 2 * num_positions + 1]
        x = F.gelu(self.conv1(input_features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [B, positions, d_model]
        x = x[:, :num_positions]
        x = x + self.embed_positions.weight[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        if self.config.pool_stride > 1:
            x = F.avg_pool1d(x.transpose(1, 2), self.config.pool_stride).transpose(1, 2)
        return self.layer_norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load transformers' WhisperEncoder tensors (`conv1.weight`, `layers.0.self_attn.q_proj.weight`, ...).
        Returns the loaded parameter names."""
        c = self.config
        heads = HeadLayout(c.num_heads, c.num_heads, c.d_model // c.num_heads)
        return load_mapped_weights(self, with_zero_k_bias(CHECKPOINT_NAMES.translate(weights, heads)), STACKED)


def with_zero_k_bias(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors, each `self_attn.q_proj.bias` followed by a zero `self_attn.k_proj.bias`: Whisper's self-attention
    keys have no bias, and the fused q/k/v projection's bias needs all three parts."""
    for name, tensor in weights:
        yield name, tensor
        if name.endswith("self_attn.q_proj.bias"):
            yield name.replace("q_proj.bias", "k_proj.bias"), torch.zeros_like(tensor)
