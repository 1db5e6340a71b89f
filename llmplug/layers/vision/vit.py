"""One vision transformer (ViT) for the CLIP, SigLIP, Idefics3, InternViT and Llama 4 families, its variants as data
(`ViTConfig`).

An image becomes a grid of patch embeddings (a strided conv), optionally led by a learned class token,
plus learned position embeddings; then an optional pre-norm and pre-LN encoder layers (bidirectional
attention over one image's patches, a two-layer MLP). The families differ only in flags:

| family            | class token | patch-conv bias | pre-norm | post-norm      | activation        | positions |
|-------------------|-------------|-----------------|----------|----------------|-------------------|-----------|
| CLIP              | yes         | no              | yes      | the pooled CLS | quick_gelu        | resized   |
| SigLIP            | no          | yes             | no       | every token    | gelu_pytorch_tanh | resized   |
| Idefics3, SmolVLM | no          | yes             | no       | every token    | gelu_pytorch_tanh | bucketed  |
| InternViT         | yes         | yes             | no       | every token    | gelu              | resized   |
| Llama 4           | yes, last   | no              | yes      | every token    | gelu              | + 2D rope |

InternViT (InternVL's tower) also scales each residual branch by a learned vector (`lambda_1`, `lambda_2`: layer
scale), may use RMSNorm for its norms and may leave out the q/k/v bias; its post-norm exists only without mean
pooling; its checkpoint names are its own (`encoder.layer.<i>.attention.projection_layer`, ...).

Llama 4's tower (`Llama4VisionModel`) puts its class token after the patches, stores its patch embedding as a linear
layer over unfolded patches (the conv's weight, flattened) and rotates q and k in every layer by a 2D rotary over the
patch grid (`axial_rotary.py`: columns first, coordinates from 1, interleaved pairs; the class token unrotated). Its
tiles always have the trained size.

Positions for a grid other than the trained one: "resized" interpolates the learned table bicubically; "bucketed"
(Idefics3's NaViT-style embeddings) gives patch (i, j) of a rows x cols grid the trained grid's entry at the bucket
of its fractional coordinates (i / rows, j / cols), computed in float32 exactly as transformers does.

A vision-language model takes the hidden states of one encoder layer (`feature_layer`, indexed like
transformers' `hidden_states`: 0 is the embeddings' output, -1 the last layer's, -2 the one before), so
the layers after it are never built and their checkpoint tensors are skipped (as vLLM does).

Attention is not paged: all of an image's patches are present at once, so it is
`scaled_dot_product_attention` over [images, heads, patches, head_dim], sharded by heads over the
tensor-parallel ranks like the decoder's (fused q/k/v column-parallel, out_proj row-parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.checkpoint_names import CheckpointNames, HeadLayout
from llmplug.layers.decoder.arch import MLPConfig
from llmplug.layers.decoder.mlp import DecoderMLP
from llmplug.layers.layernorm import LayerNorm, NormConfig, make_norm
from llmplug.layers.linear import QKVParallelLinear, RowParallelLinear
from llmplug.layers.rotary import RotaryCosSin
from llmplug.layers.vision.axial_rotary import axial_angles, interleaved_rotation
from llmplug.layers.weight_utils import StackedParamsMap, default_weight_loader, frozen_parameter, load_mapped_weights

__all__ = ["VIT_LAYOUTS", "ViTConfig", "ViTLayout", "VisionTransformer", "vit_config"]

PostNorm = Literal["pooled", "tokens"]


# transformers' checkpoint names -> ours: q/k/v fused (STACKED), fc1/fc2 are the shared MLP's up/down
STACKED: StackedParamsMap = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
CHECKPOINT_NAMES = CheckpointNames(
    # a CLIPVisionModel / SiglipVisionModel checkpoint keeps everything under `vision_model.` (transformers 5
    # drops it in memory); both forms load
    prefixes={
        f"vision_model.{name}": name for name in ("embeddings", "pre_layrnorm", "encoder", "post_layernorm", "head")
    },
    renames={"mlp.fc1": "mlp.up_proj", "mlp.fc2": "mlp.down_proj"},
    ignored=("position_ids",),  # a non-persistent buffer some old checkpoints saved
)
# InternVLVisionModel's names -> ours (its cls_token and position table lose their leading batch dims: `_unbatched`)
INTERNVIT_NAMES = CheckpointNames(
    prefixes={
        "embeddings.cls_token": "embeddings.class_embedding",
        "embeddings.position_embeddings": "embeddings.position_embedding.weight",
        "embeddings.patch_embeddings.projection": "embeddings.patch_embedding",
        "encoder.layer": "encoder.layers",
        "layernorm": "post_layernorm",
    },
    renames={
        **{f"attention.{p}": f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")},
        "attention.projection_layer": "self_attn.out_proj",
        "layernorm_before": "layer_norm1",
        "layernorm_after": "layer_norm2",
        "mlp.fc1": "mlp.up_proj",
        "mlp.fc2": "mlp.down_proj",
    },
    ignored=("mask_token",),  # masked-image pretraining's token, unused at inference
)
# Llama4VisionModel's names -> ours (its patch linear is reshaped into the conv's weight: `_patch_as_conv`)
LLAMA4_VIT_NAMES = CheckpointNames(
    prefixes={
        "patch_embedding.linear": "embeddings.patch_embedding",
        "class_embedding": "embeddings.class_embedding",
        "positional_embedding_vlm": "embeddings.position_embedding.weight",
        "layernorm_pre": "pre_layrnorm",
        "layernorm_post": "post_layernorm",
        "model.layers": "encoder.layers",
    },
    renames={
        "self_attn.o_proj": "self_attn.out_proj",
        "input_layernorm": "layer_norm1",
        "post_attention_layernorm": "layer_norm2",
        "mlp.fc1": "mlp.up_proj",
        "mlp.fc2": "mlp.down_proj",
    },
)
LLAMA4_NORM_EPS = 1e-5  # transformers builds Llama4VisionModel's nn.LayerNorm layers with their default eps


@dataclass(frozen=True, slots=True)
class ViTLayout:
    """What distinguishes one ViT family from another (the table in the module doc)."""

    class_token: bool  # a learned token before the patches (its position embedding is position 0)
    patch_bias: bool  # the patch conv has a bias
    pre_norm: bool  # a LayerNorm on the embeddings before the first layer (CLIP's `pre_layrnorm`)
    post_norm: PostNorm  # `post_layernorm` on the pooled class token only, or on every token of the output
    bucketed_positions: bool = False  # position ids by fractional-coordinate buckets (the module doc), not resizing
    layer_scale: bool = False  # each residual branch times a learned vector (InternViT's lambda_1, lambda_2)
    class_token_last: bool = False  # the class token after the patches (its position embedding the table's last)
    names: CheckpointNames = CHECKPOINT_NAMES  # transformers' tensor names -> ours


# HF vision config `model_type` -> its family's layout
VIT_LAYOUTS: dict[str, ViTLayout] = {
    "clip_vision_model": ViTLayout(class_token=True, patch_bias=False, pre_norm=True, post_norm="pooled"),
    "siglip_vision_model": ViTLayout(class_token=False, patch_bias=True, pre_norm=False, post_norm="tokens"),
    "idefics3_vision": ViTLayout(class_token=False, patch_bias=True, pre_norm=False, post_norm="tokens",
                                 bucketed_positions=True),
    "smolvlm_vision": ViTLayout(class_token=False, patch_bias=True, pre_norm=False, post_norm="tokens",
                                bucketed_positions=True),
    "internvl_vision": ViTLayout(class_token=True, patch_bias=True, pre_norm=False, post_norm="tokens",
                                 layer_scale=True, names=INTERNVIT_NAMES),
    "llama4_vision_model": ViTLayout(class_token=True, patch_bias=False, pre_norm=True, post_norm="tokens",
                                     class_token_last=True, names=LLAMA4_VIT_NAMES),
}


@dataclass(frozen=True, slots=True)
class ViTConfig:
    """A vision transformer's shape and family layout, read once from its HF vision config."""

    layout: ViTLayout
    hidden_size: int
    intermediate_size: int
    num_layers: int  # in the checkpoint; fewer are built when a feature layer comes earlier
    num_heads: int
    image_size: int  # the square size the position embeddings were trained for
    patch_size: int
    num_channels: int
    activation: str  # a name of llmplug.layers.activation.ACTIVATIONS
    eps: float
    norm: Literal["layer", "rms"] = "layer"  # the encoder layers' and the post-norm's kind
    qkv_bias: bool = True
    rope_theta: float | None = None  # a 2D rotary over the patch grid in every layer (Llama 4's); None: none

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_size(self) -> int:
        """Patches per side of a trained-size image."""
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        """Learned position embeddings: one per patch of a trained-size image, plus the class token's."""
        return self.grid_size**2 + int(self.layout.class_token)


def vit_config(hf: PretrainedConfig) -> ViTConfig:
    """The `ViTConfig` of a CLIP, SigLIP, Idefics3 or InternViT vision config (a VLM's `vision_config`)."""
    layout = VIT_LAYOUTS.get(hf.model_type)
    if layout is None:
        raise ValueError(
            f"vision config of model_type {hf.model_type!r} is not a ViT llmplug builds; known: {sorted(VIT_LAYOUTS)}"
        )
    if hf.model_type == "internvl_vision":
        return _internvit_config(hf, layout)
    if hf.model_type == "llama4_vision_model":
        return _llama4_vit_config(hf, layout)
    return ViTConfig(**_shared_fields(hf, layout), image_size=hf.image_size, patch_size=hf.patch_size,
                     activation=hf.hidden_act, eps=hf.layer_norm_eps)


def _shared_fields(hf: PretrainedConfig, layout: ViTLayout) -> dict[str, Any]:
    """The ViTConfig fields every vision config names alike."""
    return {"layout": layout, "hidden_size": hf.hidden_size, "intermediate_size": hf.intermediate_size,
            "num_layers": hf.num_hidden_layers, "num_heads": hf.num_attention_heads, "num_channels": hf.num_channels}


def _internvit_config(hf: PretrainedConfig, layout: ViTLayout) -> ViTConfig:
    """InternVLVisionConfig: sizes as (height, width) pairs, a norm kind, an optional q/k/v bias."""
    if hf.use_qk_norm or not hf.use_absolute_position_embeddings:
        raise ValueError("InternViT with q/k norms (use_qk_norm, InternViT-6B) or without absolute position "
                         "embeddings is not built by llmplug yet")
    return ViTConfig(
        **_shared_fields(hf, layout),
        image_size=_square(hf.image_size, "image_size"),
        patch_size=_square(hf.patch_size, "patch_size"),
        activation=hf.hidden_act,
        eps=hf.layer_norm_eps,
        norm=_norm_kind(hf.norm_type),
        qkv_bias=bool(hf.attention_bias),
    )


def _llama4_vit_config(hf: PretrainedConfig, layout: ViTLayout) -> ViTConfig:
    """Llama4VisionConfig: GELU and LayerNorm eps fixed in transformers' code, a 2D rotary of `rope_theta`."""
    rope = hf.rope_parameters
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Llama 4's vision rotary is unscaled; its config asks for rope_type {rope['rope_type']!r}")
    return ViTConfig(
        **_shared_fields(hf, layout),
        image_size=hf.image_size,
        patch_size=hf.patch_size,
        activation="gelu",  # transformers' Llama4VisionMLP is nn.GELU() whatever hidden_act says
        eps=LLAMA4_NORM_EPS,
        rope_theta=float(rope["rope_theta"]),
    )


def _norm_kind(norm_type: str) -> Literal["layer", "rms"]:
    """InternVLVisionConfig's `norm_type` as a ViTConfig norm kind."""
    if norm_type not in ("layer_norm", "rms_norm"):
        raise ValueError(f"InternViT norm_type {norm_type!r} is not 'layer_norm' or 'rms_norm'")
    return "layer" if norm_type == "layer_norm" else "rms"


def _square(size: int | list[int] | tuple[int, ...], name: str) -> int:
    """The side of a square size given as an int or a (height, width) pair."""
    sides = {int(size)} if isinstance(size, int) else {int(side) for side in size}
    if len(sides) != 1:
        raise ValueError(f"vision {name} {size} is not square; llmplug's ViT takes square trained sizes")
    return sides.pop()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _frozen_module(module: nn.Module) -> nn.Module:
    """`module` with its parameters frozen and loaded whole (`default_weight_loader`)."""
    for param in module.parameters():
        param.requires_grad_(False)
        param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return module


class VisionEmbeddings(nn.Module):
    """pixel_values [B, C, H, W] -> [B, (1 +) patches, hidden]: patch conv, class token, position embeddings.

    Another image size than the trained one gets its position embeddings resized bicubically over the
    patch grid (transformers' `interpolate_pos_encoding`); the class token's stays as it is.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.patch_embedding = _frozen_module(
            nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size, bias=c.layout.patch_bias)
        )
        if c.layout.class_token:
            self.class_embedding = frozen_parameter(torch.empty(c.hidden_size), default_weight_loader)
        self.position_embedding = _frozen_module(nn.Embedding(c.num_positions, c.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.dtype))  # [B, hidden, rows, cols]
        rows, cols = patches.shape[-2:]
        embeddings = patches.flatten(2).transpose(1, 2)  # [B, rows * cols, hidden]
        if self.config.layout.class_token:
            cls = self.class_embedding.expand(embeddings.shape[0], 1, -1).to(embeddings.dtype)
            last = self.config.layout.class_token_last
            embeddings = torch.cat([embeddings, cls] if last else [cls, embeddings], dim=1)
        return embeddings + self._positions(rows, cols)

    def _positions(self, rows: int, cols: int) -> torch.Tensor:
        """[(1 +) rows * cols, hidden]: the learned table, resized when the grid is not the trained one."""
        table = self.position_embedding.weight  # [num_positions, hidden]
        g = self.config.grid_size
        if self.config.layout.bucketed_positions:
            return table[_bucketed_position_ids(rows, cols, g).to(table.device)]
        if (rows, cols) == (g, g):
            return table
        layout, n = self.config.layout, g * g
        cls, patches = (table[n:], table[:n]) if layout.class_token_last else (table[: len(table) - n], table[-n:])
        grid = patches.reshape(1, g, g, -1).permute(0, 3, 1, 2)  # [1, hidden, g, g]
        grid = F.interpolate(grid, size=(rows, cols), mode="bicubic", align_corners=False)
        grid = grid.permute(0, 2, 3, 1).reshape(rows * cols, -1)
        return torch.cat([grid, cls] if layout.class_token_last else [cls, grid])


def _bucketed_position_ids(rows: int, cols: int, grid: int) -> torch.Tensor:
    """[rows * cols] ids into a grid x grid table: each patch's fractional coordinates bucketed as transformers'
    Idefics3VisionEmbeddings does (float32, so even a trained-size grid may map a patch to its neighbour's id)."""
    boundaries = torch.arange(1 / grid, 1.0, 1 / grid)

    def buckets(n: int) -> torch.Tensor:
        step = 1.0 / torch.tensor([n])  # float32, as transformers computes it from the patch mask's counts
        fractions = torch.clamp(torch.arange(n, dtype=torch.float32) * step, max=1.0 - 1e-6)
        return torch.bucketize(fractions, boundaries, right=True)

    return (buckets(rows)[:, None] * grid + buckets(cols)[None, :]).flatten()


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over each image's tokens, this rank's heads."""

    def __init__(self, config: ViTConfig, prefix: str = "") -> None:
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_heads, config.num_heads, bias=config.qkv_bias,
            prefix=_join(prefix, "qkv_proj"),
        )
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, prefix=_join(prefix, "out_proj"))
        self.num_heads, self.head_dim = self.qkv_proj.num_heads, d

    def forward(self, x: torch.Tensor, rotation: RotaryCosSin | None = None) -> torch.Tensor:
        """[B, N, hidden] -> [B, N, hidden]; `rotation` (of the N tokens) rotates q and k first."""
        b, n, _ = x.shape
        qkv = self.qkv_proj(x).view(b, n, 3, self.num_heads, self.head_dim)  # [B, N, (q, k, v), H, D]
        if rotation is not None:
            rotation.apply_(qkv[:, :, 0])
            rotation.apply_(qkv[:, :, 1])
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, N, D]
        out = F.scaled_dot_product_attention(q, k, v)  # scale 1 / sqrt(D), as the checkpoints were trained
        return self.out_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class VisionEncoderLayer(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); with layer scale each branch is first multiplied by its lambda."""

    def __init__(self, config: ViTConfig, prefix: str = "") -> None:
        super().__init__()
        self.layer_norm1 = _norm(config)
        self.self_attn = VisionAttention(config, _join(prefix, "self_attn"))
        self.layer_norm2 = _norm(config)
        mlp = MLPConfig(activation=config.activation, gated=False, bias=True)
        self.mlp = DecoderMLP(mlp, config.hidden_size, config.intermediate_size, _join(prefix, "mlp"))
        self.layer_scale = config.layout.layer_scale
        if self.layer_scale:
            self.lambda_1 = frozen_parameter(torch.empty(config.hidden_size), default_weight_loader)
            self.lambda_2 = frozen_parameter(torch.empty(config.hidden_size), default_weight_loader)

    def forward(self, x: torch.Tensor, rotation: RotaryCosSin | None = None) -> torch.Tensor:
        """[B, N, hidden] -> [B, N, hidden]."""
        attn = self.self_attn(self.layer_norm1(x), rotation)
        x = x + (self.lambda_1 * attn if self.layer_scale else attn)
        mlp = self.mlp(self.layer_norm2(x))
        return x + (self.lambda_2 * mlp if self.layer_scale else mlp)


def _norm(config: ViTConfig) -> nn.Module:
    """The encoder's LayerNorm (with a bias) or RMSNorm over the hidden features."""
    return make_norm(NormConfig(config.norm, config.eps, bias=config.norm == "layer"), config.hidden_size)


class VisionEncoder(nn.Module):
    """The stack of encoder layers (those up to the chosen feature layer)."""

    def __init__(self, config: ViTConfig, num_layers: int, prefix: str = "") -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(config, _join(prefix, f"layers.{i}")) for i in range(num_layers)
        )


class VisionTransformer(nn.Module):
    """pixel_values [B, C, H, W] -> [B, tokens, hidden]: the hidden states of `feature_layer`.

    `feature_layer`: None gives transformers' `last_hidden_state` (SigLIP's post-norm applied; CLIP's
    post-norm is on the pooled class token only, see `pool`); an int i gives `hidden_states[i]` (never
    post-normed); a sequence gives those layers' states concatenated along the features, in its order.
    Only the layers up to the deepest one asked for are built.
    """

    def __init__(
        self, config: ViTConfig, feature_layer: int | tuple[int, ...] | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.config, self.feature_layer = config, feature_layer
        self.feature_indices = self._indices(config, feature_layer)
        self.embeddings = VisionEmbeddings(config)
        if config.layout.pre_norm:
            self.pre_layrnorm = LayerNorm(config.hidden_size, config.eps)  # transformers' spelling, kept
        num_built = max(self.feature_indices) if self.feature_indices else config.num_layers
        self.encoder = VisionEncoder(config, num_built, _join(prefix, "encoder"))
        if feature_layer is None:  # the post-norm is only ever applied after the last layer
            self.post_layernorm = _norm(config)

    @staticmethod
    def _indices(config: ViTConfig, feature_layer: int | tuple[int, ...] | None) -> tuple[int, ...]:
        """The non-negative `hidden_states` indices asked for (empty: the last hidden state)."""
        if feature_layer is None:
            return ()
        layers = (feature_layer,) if isinstance(feature_layer, int) else tuple(feature_layer)
        count = config.num_layers + 1  # hidden_states: the embeddings' output, then each layer's
        for layer in layers:
            if not -count <= layer < count:
                raise ValueError(
                    f"vision feature layer {layer} is outside the {count} hidden states of a "
                    f"{config.num_layers}-layer vision encoder (indices {-count}..{count - 1})"
                )
        return tuple(layer % count for layer in layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, (1 +) patches, hidden (times the number of feature layers)]."""
        x = self.embeddings(pixel_values)  # [B, (1 +) patches, hidden]
        if self.config.layout.pre_norm:
            x = self.pre_layrnorm(x)
        states = {0: x}
        rotation = self._rotation(x.dtype)
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = states[i] = layer(x, rotation)
        if not self.feature_indices:
            return self.post_layernorm(x) if self.config.layout.post_norm == "tokens" else x
        return torch.cat([states[i] for i in self.feature_indices], dim=-1)

    def _rotation(self, dtype: torch.dtype) -> RotaryCosSin | None:
        """The 2D rotary of a trained-size grid and its class token (unrotated), or None without one."""
        c = self.config
        if c.rope_theta is None:
            return None
        g = c.grid_size
        angles = axial_angles(g, g, c.head_dim, c.rope_theta, columns_first=True, shared_frequencies=True, offset=1)
        cls = angles.new_zeros(int(c.layout.class_token), angles.shape[1])
        angles = torch.cat([angles, cls] if c.layout.class_token_last else [cls, angles])  # [tokens, D / 2]
        return interleaved_rotation(angles.to(self.embeddings.position_embedding.weight.device), dtype)

    def pool(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """CLIP's pooled output: post_layernorm(last_hidden_state[:, 0]) [B, hidden] (the class token's)."""
        if self.config.layout.post_norm != "pooled" or self.feature_layer is not None:
            raise ValueError("only a CLIP-layout ViT built with feature_layer=None has a pooled class token")
        return self.post_layernorm(last_hidden_state[:, 0])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a CLIPVisionModel / SiglipVisionModel's tensors (with or without `vision_model.`), or an
        InternVLVisionModel's; the layers and norms this encoder does not build, and SigLIP's attention-pooling
        `head`, are skipped. Returns the loaded parameter names."""
        c = self.config
        heads = HeadLayout(c.num_heads, c.num_heads, c.head_dim)
        translated = c.layout.names.translate(weights, heads)
        return load_mapped_weights(self, self._built_only(self._patch_as_conv(_unbatched(translated))), STACKED)

    def _patch_as_conv(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """(Our-named) tensors, a patch embedding stored as a linear layer over unfolded patches ([hidden,
        C * p * p], Llama 4's) reshaped into the conv's weight: torch's unfold lays a patch out channel-major, as
        the conv's weight is."""
        shape = self.embeddings.patch_embedding.weight.shape
        for name, tensor in weights:
            yield (name, tensor.reshape(shape)) if name == "embeddings.patch_embedding.weight" else (name, tensor)

    def _built_only(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The (our-named) tensors of the modules this encoder built."""
        num_built = len(self.encoder.layers)
        for name, tensor in weights:
            parts = name.split(".")
            if parts[:2] == ["encoder", "layers"] and int(parts[2]) >= num_built:
                continue
            if parts[0] == "head" or (parts[0] == "post_layernorm" and not hasattr(self, "post_layernorm")):
                continue
            yield name, tensor


# the tensors InternViT stores with leading batch dimensions: cls_token [1, 1, hidden], position_embeddings
# [1, positions, hidden] -> ours, [hidden] and [positions, hidden]
UNBATCHED_DIMS = {"embeddings.class_embedding": 1, "embeddings.position_embedding.weight": 2}


def _unbatched(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """(Our-named) tensors, those of UNBATCHED_DIMS without their leading size-1 dimensions."""
    for name, tensor in weights:
        dims = UNBATCHED_DIMS.get(name)
        while dims is not None and tensor.dim() > dims and tensor.shape[0] == 1:
            tensor = tensor[0]
        yield name, tensor
