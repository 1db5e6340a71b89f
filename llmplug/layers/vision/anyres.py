"""Any-resolution images (LLaVA-NeXT's "anyres"): an image is resized into the best of a list of grid resolutions
(`image_grid_pinpoints`), cut into tiles of the vision tower's size and sent, after one tile of the whole image
resized (the base), as `pixel_values` [1 + tiles, C, tile, tile] with its original `image_sizes` (height, width).

After the tower and the projector, `pack_anyres` lays each image's rows out as transformers'
`LlavaNextModel.pack_image_features` does: the base tile's rows, then the tiles' rows stitched into one feature
map, the padding the resize added cut off again (`unpad_features`), with a learned newline row after each row of
it. The processor counts the same rows (its `_get_number_of_features`), so the packed rows fill the image's
placeholders exactly. The grid math follows transformers' `select_best_resolution` to the integer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AnyResGrid", "select_best_resolution", "unpad_features"]


def select_best_resolution(image_size: tuple[int, int], resolutions: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The (height, width) of `resolutions` that keeps most of the image's pixels, then wastes the fewest."""
    height, width = image_size
    best, best_effective, best_wasted = resolutions[0], 0, math.inf
    for h, w in resolutions:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (h, w), effective, wasted
    return best


def unpad_features(features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """features [C, H, W] of an image padded to H x W keeping its aspect ratio -> the rows and columns it covers."""
    height, width = image_size
    current_height, current_width = features.shape[1:]
    if width / height > current_width / current_height:  # wider: padded above and below
        new_height = int(round(height * (current_width / width), 7))
        padding = (current_height - new_height) // 2
        return features[:, padding : current_height - padding, :]
    new_width = int(round(width * (current_height / height), 7))
    padding = (current_width - new_width) // 2
    return features[:, :, padding : current_width - padding]


@dataclass(frozen=True, slots=True)
class AnyResGrid:
    """The tiling of an anyres model: its grid resolutions, the tower's tile size and patches per tile side."""

    pinpoints: tuple[tuple[int, int], ...]  # (height, width) in pixels, each a multiple of tile_size
    tile_size: int  # pixels per tile side: the vision tower's image_size
    patches_per_side: int  # the tower's patches per tile side: image_size // patch_size

    def grid_shape(self, image_size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of tiles for an image of (height, width)."""
        height, width = select_best_resolution(image_size, self.pinpoints)
        return height // self.tile_size, width // self.tile_size

    def num_tiles(self, image_size: tuple[int, int]) -> int:
        """The base tile plus the grid's tiles: the image's rows of pixel_values that are not batch padding."""
        height, width = select_best_resolution(image_size, self.pinpoints)
        return 1 + math.ceil(height / self.tile_size) * math.ceil(width / self.tile_size)

    def pack(self, features: torch.Tensor, image_size: tuple[int, int], newline: torch.Tensor) -> torch.Tensor:
        """features [1 + tiles, patches_per_side ** 2, hidden] of one image -> its placeholder rows [rows, hidden]:
        the base tile's, then the unpadded tile map row by row, each row followed by `newline` [hidden]."""
        base, tiles = features[0], features[1:]
        if tiles.shape[0] == 0:  # the base tile alone
            return torch.cat([base, newline[None].to(base)])
        rows, cols = self.grid_shape(image_size)
        side = self.patches_per_side
        tiles = tiles.view(rows, cols, side, side, -1)  # [grid rows, grid cols, patch rows, patch cols, hidden]
        feature_map = tiles.permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)  # [hidden, rows*side, cols*side]
        feature_map = unpad_features(feature_map, image_size)  # [hidden, H', W']
        newlines = newline[:, None, None].expand(*feature_map.shape[:-1], 1).to(feature_map)
        feature_map = torch.cat([feature_map, newlines], dim=-1)  # [hidden, H', W' + 1]
        return torch.cat([base, feature_map.flatten(1, 2).transpose(0, 1)])  # [side**2 + H' * (W' + 1), hidden]
