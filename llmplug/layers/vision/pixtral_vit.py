"""The Pixtral vision encoder (`PixtralVisionModel`, Mistral 3's tower), its sizes as data (`PixtralViTConfig`).

Each image keeps its own size (the processor resizes it to multiples of the patch size, never to a square): a
bias-free patch conv gives a rows x cols grid, flattened row by row and RMS-normed (`ln_pre`); then pre-norm layers —
RMSNorm, attention, RMSNorm, a SwiGLU MLP, all bias-free. There are no learned positions: q and k are rotated by an
axial 2D rotary over each patch's (row, column), the first half of the rotated frequencies by the row and the second
by the column (rotate-half pairs over the whole head). Several images are one sequence whose attention is
block-diagonal: each patch sees only its own image's.

Attention is not paged (all of an image's patches are present at once), sharded by heads over the tensor-parallel
ranks like the decoder's (fused q/k/v column-parallel, o_proj row-parallel; the MLP's gate/up column-parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.decoder.arch import MLPConfig
from llmplug.layers.decoder.mlp import DecoderMLP
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.linear import QKVParallelLinear, RowParallelLinear
from llmplug.layers.vision.axial_rotary import axial_angles
from llmplug.layers.weight_utils import StackedParamsMap, default_weight_loader, load_mapped_weights

__all__ = ["PixtralViTConfig", "PixtralVisionTransformer", "pixtral_vit_config"]

NORM_EPS = 1e-5  # transformers' PixtralRMSNorm layers are built with this eps whatever the config says


@dataclass(frozen=True, slots=True)
class PixtralViTConfig:
    """A Pixtral encoder's shape, read once from its HF `PixtralVisionConfig`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    num_channels: int
    activation: str  # the SwiGLU's gate activation, a name of llmplug.layers.activation.ACTIVATIONS
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def pixtral_vit_config(hf: PretrainedConfig) -> PixtralViTConfig:
    """The `PixtralViTConfig` of a `PixtralVisionConfig` (Mistral 3's `vision_config`)."""
    rope = hf.rope_parameters
    if rope["rope_type"] != "axial":
        raise ValueError(f"Pixtral's rotary is axial; its vision config asks for rope_type {rope['rope_type']!r}")
    return PixtralViTConfig(
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        patch_size=hf.patch_size,
        num_channels=hf.num_channels,
        activation=hf.hidden_act,
        rope_theta=float(rope["rope_theta"]),
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _rotate_half_angles(rows: int, cols: int, config: PixtralViTConfig) -> torch.Tensor:
    """[rows * cols, head_dim] rotary angles of a grid, row-major: the first quarter of the frequencies (the even
    ones of a 1D rotary's) times the row, the next quarter (the odd ones) times the column, repeated for rotate-half
    pairs."""
    angles = axial_angles(rows, cols, config.head_dim, config.rope_theta)
    return torch.cat([angles, angles], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by cos, sin [N, D] (rotate-half pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class PixtralAttention(nn.Module):
    """Bidirectional attention of this rank's heads over the patches, each image within itself."""

    def __init__(self, config: PixtralViTConfig, prefix: str = "") -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_heads, config.num_heads, bias=False,
                                          prefix=_join(prefix, "qkv_proj"))
        self.o_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=False,
                                        prefix=_join(prefix, "o_proj"))
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, d

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [N, hidden], cos/sin [N, D], mask [N, N] (True: may attend) or None -> [N, hidden]."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, H, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask)  # [H, N, D], scale 1 / sqrt(D)
        return self.o_proj(out.transpose(0, 1).reshape(n, self.num_heads * self.head_dim))


class PixtralLayer(nn.Module):
    """x + attention(attention_norm(x)), then x + feed_forward(ffn_norm(x))."""

    def __init__(self, config: PixtralViTConfig, prefix: str = "") -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, NORM_EPS)
        self.attention = PixtralAttention(config, _join(prefix, "attention"))
        self.ffn_norm = RMSNorm(config.hidden_size, NORM_EPS)
        mlp = MLPConfig(activation=config.activation, gated=True, bias=False)
        self.feed_forward = DecoderMLP(mlp, config.hidden_size, config.intermediate_size,
                                       _join(prefix, "feed_forward"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    """Holds the layers under transformers' module path (`transformer.layers.<i>`)."""

    def __init__(self, config: PixtralViTConfig, prefix: str = "") -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralLayer(config, _join(prefix, f"layers.{i}"))
                                    for i in range(config.num_layers))


STACKED: StackedParamsMap = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class PixtralVisionTransformer(nn.Module):
    """images, each [C, H, W] with H and W multiples of the patch size -> [their patches, hidden]: the last layer's
    hidden states (transformers' `hidden_states[-1]`; Pixtral has no final norm), image after image, row-major."""

    def __init__(self, config: PixtralViTConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        c = config
        self.patch_conv = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size, bias=False)
        for param in self.patch_conv.parameters():
            param.requires_grad_(False)
            param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.ln_pre = RMSNorm(c.hidden_size, NORM_EPS)
        self.transformer = PixtralTransformer(c, _join(prefix, "transformer"))

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of patches of an image of this size (the processor makes both multiples of the patch)."""
        p = self.config.patch_size
        if height % p or width % p:
            raise ValueError(f"a {height}x{width} image is not a whole number of {p}x{p} patches")
        return height // p, width // p

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        weight = self.patch_conv.weight
        grids = [self.grid(*image.shape[-2:]) for image in images]
        patches = [self.patch_conv(image[None].to(weight.dtype))[0].flatten(1).T for image in images]
        x = self.ln_pre(torch.cat(patches))  # [N, hidden]
        angles = torch.cat([_rotate_half_angles(rows, cols, self.config) for rows, cols in grids]).to(x.device)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # [N, D]
        mask = _block_diagonal([p.shape[0] for p in patches], x.device) if len(images) > 1 else None
        for layer in self.transformer.layers:
            x = layer(x, cos, sin, mask)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a PixtralVisionModel's tensors (transformers' names, q/k/v and gate/up fused here); the rotary's
        inverse frequencies are computed, not loaded. Returns the loaded parameter names."""
        return load_mapped_weights(self, weights, STACKED)


def _block_diagonal(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[N, N] bool: True where query and key patches belong to the same image."""
    image = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    return image[:, None] == image[None, :]
