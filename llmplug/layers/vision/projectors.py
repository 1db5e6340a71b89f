"""Projectors: a vision encoder's patch features [B, patches, vision_hidden] -> the language model's
embeddings [B, tokens, text_hidden], one module per kind, each loading transformers' checkpoint names.

- `MLPProjector` (LLaVA's `multi_modal_projector`): linear_1 -> act -> linear_2, one token per patch;
- `PooledProjector` (Gemma 3's): the patch grid average-pooled to `mm_tokens_per_image`, Gemma RMSNorm
  (`1 + w`), then a matmul with `mm_input_projection_weight` ([vision_hidden, text_hidden], stored
  transposed to a linear layer's);
- `PixelShuffleConnector` (Idefics3 / SmolVLM's `connector`): each `scale_factor` x `scale_factor` block
  of patches folded into one token of scale_factor**2 times the features, then a bias-free linear;
- `ShuffledMLPProjector` (InternVL's and Aya Vision's `multi_modal_projector`, Llama 4's `vision_adapter`): the same
  pixel shuffle, a LayerNorm, then linear_1 -> act -> linear_2 (InternVL) or a SwiGLU over linear_1's two halves (Aya
  Vision); Llama 4's without the norm or biases, its output activated too;
- `PatchMergerProjector` (Mistral 3's): RMSNorm, the patch merger (each `merge_size` x `merge_size` block of an
  image's patch grid one token, a bias-free linear back to the vision width), then LLaVA's MLP;
- `LinearProjector` (PaliGemma's; Llama 4's, without bias): one linear layer, one token per patch.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmplug.layers.activation import Activation
from llmplug.layers.layernorm import LayerNorm, RMSNorm
from llmplug.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from llmplug.layers.weight_utils import load_mapped_weights

__all__ = [
    "LinearProjector",
    "MLPProjector",
    "PatchMergerProjector",
    "PixelShuffleConnector",
    "PooledProjector",
    "ShuffledMLPProjector",
    "pixel_shuffle",
]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class MLPProjector(nn.Module):
    """linear_2(act(linear_1(x))): [..., vision_hidden] -> [..., text_hidden]; linear_1 column- and linear_2
    row-parallel, so the output is whole on every rank."""

    def __init__(
        self, vision_hidden: int, text_hidden: int, activation: str = "gelu", bias: bool = True, prefix: str = ""
    ) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(vision_hidden, text_hidden, bias, prefix=_join(prefix, "linear_1"))
        self.act = Activation(activation)
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias, prefix=_join(prefix, "linear_2"))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `linear_1.*` / `linear_2.*` (names below `multi_modal_projector.`)."""
        return load_mapped_weights(self, weights)


class LinearProjector(nn.Module):
    """linear(x): [..., vision_hidden] -> [..., text_hidden], replicated (its output is merged into every rank's
    embeddings)."""

    def __init__(self, vision_hidden: int, text_hidden: int, prefix: str = "", bias: bool = True) -> None:
        super().__init__()
        self.linear = ReplicatedLinear(vision_hidden, text_hidden, bias=bias, prefix=_join(prefix, "linear"))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `linear.weight` and `linear.bias` if it has one (names below `multi_modal_projector.`)."""
        return load_mapped_weights(self, weights)


class PooledProjector(nn.Module):
    """[B, grid * grid, vision_hidden] -> [B, tokens_per_image, text_hidden]: average-pool the patch grid, norm,
    project. Replicated on every rank (it is one small matrix)."""

    def __init__(
        self, vision_hidden: int, text_hidden: int, patches_per_side: int, tokens_per_image: int, eps: float,
        prefix: str = "",
    ) -> None:
        super().__init__()
        tokens_per_side = int(tokens_per_image**0.5)
        if tokens_per_side**2 != tokens_per_image or patches_per_side % tokens_per_side:
            raise ValueError(
                f"{tokens_per_image} tokens per image must be a square whose side divides the {patches_per_side} "
                "patches per side of the vision grid"
            )
        self.patches_per_side, self.kernel = patches_per_side, patches_per_side // tokens_per_side
        self.mm_soft_emb_norm = RMSNorm(vision_hidden, eps, weight_offset=1.0)
        self.projection = ReplicatedLinear(vision_hidden, text_hidden, bias=False, prefix=_join(prefix, "projection"))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        b, _, hidden = features.shape
        grid = features.transpose(1, 2).reshape(b, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [B, tokens, hidden]
        return self.projection(self.mm_soft_emb_norm(pooled))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `mm_soft_emb_norm.weight` and `mm_input_projection_weight` (its [in, out] transposed)."""
        return load_mapped_weights(self, _projection_as_linear(weights))


def _projection_as_linear(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """Gemma 3 stores its projection as a bare [vision_hidden, text_hidden] matrix: our linear's weight, transposed."""
    for name, tensor in weights:
        yield ("projection.weight", tensor.t()) if name == "mm_input_projection_weight" else (name, tensor)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[B, side * side, C] -> [B, side * side / scale**2, C * scale**2]: each scale x scale block of the patch grid
    becomes one token, in transformers' Idefics3 order."""
    b, n, c = x.shape
    side = int(n**0.5)
    if side * side != n or side % scale:
        raise ValueError(f"{n} patches are not a square grid whose side divides by the scale factor {scale}")
    x = x.view(b, side, side // scale, c * scale)  # columns folded in groups of `scale`
    x = x.permute(0, 2, 1, 3).reshape(b, side // scale, side // scale, c * scale * scale)  # then rows
    return x.permute(0, 2, 1, 3).reshape(b, n // (scale * scale), c * scale * scale)


class PixelShuffleConnector(nn.Module):
    """[B, patches, vision_hidden] -> [B, patches / scale**2, text_hidden]: pixel shuffle, then a bias-free linear
    (replicated: its output is merged into every rank's embeddings)."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int, prefix: str = "") -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = _ModalityProjection(
            vision_hidden * scale_factor**2, text_hidden, _join(prefix, "modality_projection")
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(features, self.scale_factor))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `modality_projection.proj.weight` (names below `connector.`)."""
        return load_mapped_weights(self, weights)


class _ModalityProjection(nn.Module):
    """Holds `proj` under transformers' module path (`modality_projection.proj`)."""

    def __init__(self, input_size: int, output_size: int, prefix: str) -> None:
        super().__init__()
        self.proj = ReplicatedLinear(input_size, output_size, bias=False, prefix=_join(prefix, "proj"))


class ShuffledMLPProjector(nn.Module):
    """[B, patches, vision_hidden] -> [B, patches / scale**2, text_hidden]: pixel shuffle, LayerNorm, then
    linear_2(act(linear_1(x))), or with `gated` linear_2(silu(b) * a) where a, b are linear_1's output halves (Aya
    Vision's SwiGLU, its gate second). Replicated on every rank: its output is merged into every rank's embeddings,
    and a gated linear_1 cannot be split by columns without pairing each rank's halves.

    `eps` None: no LayerNorm; `bias`: the linear layers'; `output_activation`: act applied to linear_2's output too
    (Llama 4's vision adapter)."""

    def __init__(
        self, vision_hidden: int, text_hidden: int, scale_factor: int, eps: float | None, activation: str = "gelu",
        gated: bool = False, intermediate_size: int | None = None, prefix: str = "", bias: bool = True,
        output_activation: bool = False,
    ) -> None:
        super().__init__()
        folded, intermediate = vision_hidden * scale_factor**2, intermediate_size or text_hidden
        if gated and intermediate % 2:
            raise ValueError(f"a gated projector splits its {intermediate} intermediate features in halves: use an "
                             "even alignment_intermediate_size")
        self.scale_factor, self.gated, self.output_activation = scale_factor, gated, output_activation
        self.layer_norm = LayerNorm(folded, eps) if eps is not None else nn.Identity()
        self.linear_1 = ReplicatedLinear(folded, intermediate, bias=bias, prefix=_join(prefix, "linear_1"))
        self.act = Activation("silu" if gated else activation)
        hidden_in = intermediate // 2 if gated else intermediate
        self.linear_2 = ReplicatedLinear(hidden_in, text_hidden, bias=bias, prefix=_join(prefix, "linear_2"))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(self.layer_norm(pixel_shuffle(features, self.scale_factor)))  # [B, tokens, intermediate]
        if self.gated:
            x, gate = x.chunk(2, dim=-1)
            return self.linear_2(self.act(gate) * x)
        x = self.linear_2(self.act(x))
        return self.act(x) if self.output_activation else x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `layer_norm.*`, `linear_1.*`, `linear_2.*` (names below `multi_modal_projector.`)."""
        return load_mapped_weights(self, weights)


class PatchMergerProjector(MLPProjector):
    """[rows * cols, vision_hidden] (one image's patch grid, row-major) -> [rows * cols / merge_size**2, text_hidden]:
    RMSNorm, the patch merger, then linear_1 -> act -> linear_2 (LLaVA's MLP, sharded as there)."""

    def __init__(
        self, vision_hidden: int, text_hidden: int, merge_size: int, eps: float, activation: str = "gelu",
        bias: bool = False, prefix: str = "",
    ) -> None:
        super().__init__(vision_hidden, text_hidden, activation, bias, prefix)
        self.norm = RMSNorm(vision_hidden, eps)
        self.patch_merger = _PatchMerger(vision_hidden, merge_size, _join(prefix, "patch_merger"))

    def forward(self, features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(self.patch_merger(self.norm(features), grid))


class _PatchMerger(nn.Module):
    """Each k x k block of the grid -> one token: its k * k patches' features laid out channel-major (as torch's
    `unfold` does: feature c of block position (i, j) at c * k * k + i * k + j), then `merging_layer` (replicated)."""

    def __init__(self, hidden: int, merge_size: int, prefix: str) -> None:
        super().__init__()
        self.merge_size = merge_size
        self.merging_layer = ReplicatedLinear(hidden * merge_size**2, hidden, bias=False,
                                              prefix=_join(prefix, "merging_layer"))

    def forward(self, features: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        (rows, cols), k, hidden = grid, self.merge_size, features.shape[-1]
        if rows % k or cols % k:
            raise ValueError(f"a {rows}x{cols} patch grid does not divide into {k}x{k} blocks to merge")
        image = features.view(rows, cols, hidden).permute(2, 0, 1)[None]  # [1, hidden, rows, cols]
        blocks = F.unfold(image, kernel_size=k, stride=k)[0].T  # [rows * cols / k**2, hidden * k * k]
        return self.merging_layer(blocks)
