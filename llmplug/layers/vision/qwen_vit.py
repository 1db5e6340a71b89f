"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision transformer and its patch merger, the families' differences as data
(`QwenViTConfig`, read by `qwen_vit_config` from any of their vision configs).

The processor cuts an image into patches of `temporal_patch_size` x `patch_size` x `patch_size` (a still image
repeated over the temporal patch), flattened in rows [patches, C * T * P * P] laid out so that each
`spatial_merge_size` x `spatial_merge_size` block of the patch grid is consecutive. The tower embeds each patch
(a Conv3d whose kernel is the patch: one matmul), rotates q and k in every layer by a 2D rotary over the patch's
(row, column) — the first half of the rotated dims by the row, the second by the column — and attends within one
image at a time (`cu_seqlens`) or, in Qwen2.5-VL's windowed layers, within windows of `window_size` pixels
(patches reordered window by window, in merge blocks, and restored at the end). The merger then folds each merge
block into one token for the language model. Qwen3-VL adds learned position embeddings (a square table, resized
bilinearly to each image's patch grid) to the patch embeddings, and returns the states after its
`deepstack_visual_indexes` layers too, which their own mergers (norm after the fold) fold for the decoder.

| family     | norms     | MLP                        | attention                                      |
|------------|-----------|----------------------------|------------------------------------------------|
| Qwen2-VL   | LayerNorm | fc1 -> quick_gelu -> fc2   | whole image in every layer                     |
| Qwen2.5-VL | RMSNorm   | SwiGLU (gate, up, down)    | windows, whole image in `fullatt_block_indexes` |
| Qwen3-VL   | LayerNorm | fc1 -> gelu (tanh) -> fc2  | whole image in every layer; learned positions  |

Attention is not paged (all of an image's patches are present at once) and is sharded by heads over the
tensor-parallel ranks like the decoder's; the merger's fc1 is column- and its fc2 row-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.activation import Activation
from llmplug.layers.checkpoint_names import QKV_CONTIGUOUS, CheckpointNames, HeadLayout
from llmplug.layers.decoder.arch import MLPConfig
from llmplug.layers.decoder.mlp import DecoderMLP
from llmplug.layers.layernorm import NormConfig, make_norm
from llmplug.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmplug.layers.weight_utils import StackedParamsMap, default_weight_loader, frozen_parameter, load_mapped_weights

__all__ = ["PatchMerger", "QwenVisionTransformer", "QwenViTConfig", "qwen_vit_config"]

NORM_EPS = 1e-6  # both families' vision norms, fixed in transformers' code


@dataclass(frozen=True, slots=True)
class QwenViTConfig:
    """A Qwen2-VL-family vision tower's shape and variant."""

    hidden_size: int  # the tower's width (Qwen2-VL's `embed_dim`)
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    out_hidden_size: int  # the merger's output: the language model's width
    activation: str
    norm: NormConfig
    gated_mlp: bool
    rope_theta: float
    window_size: int | None = None  # pixels per window side; None: every layer attends over the whole image
    fullatt_block_indexes: tuple[int, ...] = ()  # with windows: the layers that attend over the whole image
    num_position_embeddings: int = 0  # a square table of learned positions (Qwen3-VL); 0: none
    patch_bias: bool = False  # the patch embedding's bias (Qwen3-VL)
    deepstack_visual_indexes: tuple[int, ...] = ()  # layers whose states the tower returns too (Qwen3-VL)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_features(self) -> int:
        """Features of one processor row: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def qwen_vit_config(hf: PretrainedConfig) -> QwenViTConfig:
    """The `QwenViTConfig` of a `Qwen2VLVisionConfig`, `Qwen2_5_VLVisionConfig` or `Qwen3VLVisionConfig`."""
    rope = getattr(hf, "rope_parameters", None) or {}
    common = dict(num_layers=hf.depth, num_heads=hf.num_heads, patch_size=hf.patch_size,
                  temporal_patch_size=hf.temporal_patch_size, in_channels=hf.in_channels,
                  spatial_merge_size=hf.spatial_merge_size, activation=hf.hidden_act,
                  rope_theta=float(rope.get("rope_theta", 10000.0)))
    if hf.model_type == "qwen2_vl_vision":
        return QwenViTConfig(hidden_size=hf.embed_dim, intermediate_size=int(hf.embed_dim * hf.mlp_ratio),
                             out_hidden_size=hf.hidden_size, norm=NormConfig("layer", NORM_EPS, bias=True),
                             gated_mlp=False, **common)
    if hf.model_type == "qwen2_5_vl_vision":
        return QwenViTConfig(hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                             out_hidden_size=hf.out_hidden_size, norm=NormConfig("rms", NORM_EPS), gated_mlp=True,
                             window_size=hf.window_size, fullatt_block_indexes=tuple(hf.fullatt_block_indexes),
                             **common)
    if hf.model_type == "qwen3_vl_vision":
        return QwenViTConfig(hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
                             out_hidden_size=hf.out_hidden_size, norm=NormConfig("layer", NORM_EPS, bias=True),
                             gated_mlp=False, num_position_embeddings=hf.num_position_embeddings, patch_bias=True,
                             deepstack_visual_indexes=tuple(hf.deepstack_visual_indexes), **common)
    raise ValueError(f"vision config of model_type {hf.model_type!r} is not a Qwen2-VL, Qwen2.5-VL or Qwen3-VL "
                     "vision tower")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def patch_coordinates(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """[t * h * w, 2] (row, column) of each patch in the processor's order: merge blocks row by row, each block's
    patches row by row, repeated for each temporal patch."""
    rows = torch.arange(h)[:, None].expand(h, w)
    cols = torch.arange(w)[None, :].expand(h, w)
    blocks = [x.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten() for x in (rows, cols)]
    return torch.stack(blocks, dim=-1).repeat(t, 1)


def window_order(t: int, h: int, w: int, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(the merge blocks of a t x h x w patch grid in window order [blocks], each window's patch count): windows of
    `window` x `window` blocks, row by row, the last row and column of windows cut by the grid's edge."""
    gh, gw = h // merge, w // merge
    index = torch.arange(t * gh * gw).view(t, gh, gw)
    order, lengths = [], []
    for frame in index:
        for top in range(0, gh, window):
            for left in range(0, gw, window):
                block = frame[top : top + window, left : left + window].flatten()
                order.append(block)
                lengths.append(block.numel() * merge * merge)
    return torch.cat(order), lengths


def rotate_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated (rotate-half pairs) by cos, sin [N, D], in float32 as transformers does."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


class PatchEmbed(nn.Module):
    """[patches, C * T * P * P] -> [patches, hidden]: the Conv3d over one patch, as a matmul."""

    def __init__(self, config: QwenViTConfig) -> None:
        super().__init__()
        c = config
        shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Module()
        self.proj.weight = frozen_parameter(torch.empty(shape), default_weight_loader)  # transformers' Conv3d name
        bias = frozen_parameter(torch.empty(c.hidden_size), default_weight_loader) if c.patch_bias else None
        self.proj.bias = bias

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.proj.bias)


class QwenVisionAttention(nn.Module):
    """Bidirectional attention within each segment of the patches (an image, or a window), this rank's heads."""

    def __init__(self, config: QwenViTConfig, prefix: str = "") -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_heads, config.num_heads, bias=True,
                                          prefix=_join(prefix, "qkv_proj"))
        self.proj = RowParallelLinear(config.hidden_size, config.hidden_size, prefix=_join(prefix, "proj"))
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, d

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        """x [N, hidden], cos/sin [N, head_dim], `segments`: lengths summing to N -> [N, hidden]."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, H, D]
        q, k = rotate_2d(q, cos, sin), rotate_2d(k, cos, sin)
        outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in parts))[0]  # [H, len, D]
                for parts in zip(*(t.split(segments) for t in (q, k, v)))]
        out = torch.cat(outs, dim=1).transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
        return self.proj(out)


class QwenVisionBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, config: QwenViTConfig, prefix: str = "") -> None:
        super().__init__()
        self.norm1 = make_norm(config.norm, config.hidden_size)
        self.attn = QwenVisionAttention(config, _join(prefix, "attn"))
        self.norm2 = make_norm(config.norm, config.hidden_size)
        mlp = MLPConfig(activation=config.activation, gated=config.gated_mlp, bias=True)
        self.mlp = DecoderMLP(mlp, config.hidden_size, config.intermediate_size, _join(prefix, "mlp"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


# transformers' checkpoint names -> ours: the fused qkv split into q/k/v (then fused again, sharded by heads),
# Qwen2-VL's fc1/fc2 are the shared MLP's up/down
STACKED: StackedParamsMap = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
GATED_STACKED: StackedParamsMap = {**STACKED, "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
CHECKPOINT_NAMES = CheckpointNames(renames={"mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj",
                                            "mlp.linear_fc1": "mlp.up_proj", "mlp.linear_fc2": "mlp.down_proj"},
                                   fused={"attn.qkv": QKV_CONTIGUOUS})


def position_grid(table: torch.Tensor, t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """[t * h * w, hidden] learned positions of a t x h x w patch grid in the processor's order: the square table
    [side * side, hidden] resized bilinearly (corners aligned) to h x w."""
    side = int(table.shape[0] ** 0.5)
    grid = table.float().t().reshape(1, -1, side, side)
    grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)[0]  # [hidden, h, w]
    grid = grid.reshape(-1, h // merge, merge, w // merge, merge).permute(1, 3, 2, 4, 0).reshape(h * w, -1)
    return grid.repeat(t, 1)


class QwenVisionTransformer(nn.Module):
    """pixel_values [patches, C * T * P * P], grid_thw [images, 3] -> the last layer's states [patches, hidden], in
    the processor's patch order (the merger folds them), and those of the `deepstack_visual_indexes` layers."""

    def __init__(self, config: QwenViTConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        if config.num_position_embeddings:
            self.pos_embed = nn.Module()
            table = torch.empty(config.num_position_embeddings, config.hidden_size)
            self.pos_embed.weight = frozen_parameter(table, default_weight_loader)  # transformers' Embedding name
        self.blocks = nn.ModuleList(QwenVisionBlock(config, _join(prefix, f"blocks.{i}"))
                                    for i in range(config.num_layers))
        half = config.head_dim // 2  # rotary dims per axis: row, then column
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 4]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        c = self.config
        grids = [tuple(int(n) for n in g) for g in grid_thw.tolist()]
        coords = torch.cat([patch_coordinates(*g, c.spatial_merge_size) for g in grids]).to(self.inv_freq.device)
        angles = (coords[:, :, None] * self.inv_freq).flatten(1)  # [N, head_dim / 2]: row angles, column angles
        angles = torch.cat((angles, angles), dim=-1)  # [N, head_dim]
        x = self.patch_embed(pixel_values)  # [N, hidden]
        if c.num_position_embeddings:
            table = self.pos_embed.weight
            x = x + torch.cat([position_grid(table, *g, c.spatial_merge_size) for g in grids]).to(x.dtype)
        frames = [h * w for t, h, w in grids for _ in range(t)]  # whole-image attention: each frame alone
        order, windows = self._window_order(grids)
        if order is not None:  # windowed layers: the patches regrouped window by window
            x, angles = x[order], angles[order]
        cos, sin = angles.cos(), angles.sin()
        states = []  # the deepstack layers' outputs, then the last layer's
        for i, block in enumerate(self.blocks):
            full = c.window_size is None or i in c.fullatt_block_indexes
            x = block(x, cos, sin, frames if full else windows)
            if i in c.deepstack_visual_indexes:
                states.append(x)
        states.append(x)
        if order is not None:  # back in the processor's order
            restore = torch.argsort(order)
            states = [s[restore] for s in states]
        return states[-1], states[:-1]

    def _window_order(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor | None, list[int]]:
        """(patch order of the windows over all images, window lengths); (None, []) without windows."""
        c = self.config
        if c.window_size is None:
            return None, []
        merge, unit = c.spatial_merge_size, c.spatial_merge_size**2
        window = c.window_size // merge // c.patch_size  # merge blocks per window side
        orders, lengths, first = [], [], 0
        for t, h, w in grids:
            blocks, sizes = window_order(t, h, w, merge, window)
            orders.append(((blocks + first)[:, None] * unit + torch.arange(unit)).flatten())
            lengths += sizes
            first += t * h * w // unit
        return torch.cat(orders).to(self.inv_freq.device), lengths

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the tower's tensors (names below `visual.`, the merger's excluded); returns the loaded names."""
        c = self.config
        heads = HeadLayout(c.num_heads, c.num_heads, c.head_dim)
        stacked = GATED_STACKED if c.gated_mlp else STACKED
        return load_mapped_weights(self, CHECKPOINT_NAMES.translate(weights, heads), stacked)


# the mergers' checkpoint prefixes -> ours (Qwen2-VL's Sequential, Qwen3-VL's named layers)
MERGER_NAMES = {"mlp.0.": "fc1.", "mlp.2.": "fc2.", "norm.": "ln_q.", "linear_fc1.": "fc1.", "linear_fc2.": "fc2."}


def _merger_name(name: str) -> str:
    source = next((p for p in MERGER_NAMES if name.startswith(p)), None)
    return name if source is None else MERGER_NAMES[source] + name[len(source):]


class PatchMerger(nn.Module):
    """[patches, vision_hidden] -> [patches / merge**2, text_hidden]: norm, each merge block's patches concatenated
    (or, `norm_after_fold`, the other way round), then fc2(gelu(fc1(x))) (transformers' `merger`: ln_q, mlp.0, mlp.2;
    Qwen3-VL's: norm, linear_fc1, linear_fc2)."""

    def __init__(self, vision_hidden: int, text_hidden: int, spatial_merge_size: int, norm: NormConfig,
                 prefix: str = "", norm_after_fold: bool = False) -> None:
        super().__init__()
        folded = vision_hidden * spatial_merge_size**2
        self.ln_q = make_norm(norm, folded if norm_after_fold else vision_hidden)
        self.fc1 = ColumnParallelLinear(folded, folded, bias=True, prefix=_join(prefix, "fc1"))
        self.act = Activation("gelu")
        self.fc2 = RowParallelLinear(folded, text_hidden, bias=True, prefix=_join(prefix, "fc2"))
        self.folded, self.norm_after_fold = folded, norm_after_fold

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.norm_after_fold:
            return self.fc2(self.act(self.fc1(self.ln_q(features.view(-1, self.folded)))))
        return self.fc2(self.act(self.fc1(self.ln_q(features).view(-1, self.folded))))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `ln_q.*`, `mlp.0.*`, `mlp.2.*` or `norm.*`, `linear_fc1.*`, `linear_fc2.*` (names below `merger.`)."""
        return load_mapped_weights(self, ((_merger_name(name), t) for name, t in weights))
