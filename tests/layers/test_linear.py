"""Parallel linear layers: each weight_loader puts the checkpoint tensors in the right rows, checks
shapes, and the layers compute x W^T + b."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmplug.core.errors import ModelLoadError
from llmplug.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)


def test_qkv_shards_land_in_q_k_v_order() -> None:
    layer = QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=2, bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard, tensor in (("v", v), ("q", q), ("k", k)):  # any order
        layer.weight_loader(layer.weight, tensor, shard)
        layer.weight_loader(layer.bias, tensor[:, 0], shard)
    torch.testing.assert_close(layer.weight, torch.cat([q, k, v]))
    torch.testing.assert_close(layer.bias, torch.cat([q, k, v])[:, 0])
    assert (layer.q_size, layer.kv_size) == (8, 4)


def test_merged_column_shards_are_stacked() -> None:
    layer = MergedColumnParallelLinear(4, [3, 3], bias=False)
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    layer.weight_loader(layer.weight, up, 1)
    layer.weight_loader(layer.weight, gate, 0)
    x = torch.randn(5, 4)
    torch.testing.assert_close(layer(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear, ReplicatedLinear])
def test_whole_layers_compute_linear(cls: type) -> None:
    layer = cls(6, 4, bias=True)
    w, b = torch.randn(4, 6), torch.randn(4)
    layer.weight_loader(layer.weight, w)
    layer.weight_loader(layer.bias, b)
    x = torch.randn(3, 6)
    torch.testing.assert_close(layer(x), F.linear(x, w, b))


def test_wrong_shapes_are_load_errors() -> None:
    qkv = QKVParallelLinear(8, head_size=2, total_num_heads=4, total_num_kv_heads=2)
    with pytest.raises(ModelLoadError, match="should have 4 entries"):
        qkv.weight_loader(qkv.weight, torch.zeros(6, 8), "k")  # too many rows must not be silently cut
    with pytest.raises(ModelLoadError, match=r"\(4, 7\)"):
        qkv.weight_loader(qkv.weight, torch.zeros(4, 7), "v")
    row = RowParallelLinear(6, 4, bias=False)
    with pytest.raises(ModelLoadError):
        row.weight_loader(row.weight, torch.zeros(4, 5))


def test_unknown_qkv_shard_is_refused() -> None:
    qkv = QKVParallelLinear(8, head_size=2, total_num_heads=4)
    with pytest.raises(ValueError, match="'q', 'k' or 'v'"):
        qkv.weight_loader(qkv.weight, torch.zeros(8, 8), "o")
