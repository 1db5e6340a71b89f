"""The generic loading loop: names map through whole dotted components, fused parameters count as
loaded only when all their shards arrived, and stray names are errors listing them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmplug.core.errors import ModelLoadError
from llmplug.layers.linear import MergedColumnParallelLinear
from llmplug.layers.weight_utils import load_mapped_weights, map_name

STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(4, [2, 2], bias=False)
        self.norm = nn.Parameter(torch.zeros(4), requires_grad=False)


def test_names_map_through_whole_components_only() -> None:
    assert map_name("layers.0.up_proj.weight", STACKED) == ("layers.0.gate_up_proj.weight", 1)
    assert map_name("layers.0.up_proj_extra.weight", STACKED) == ("layers.0.up_proj_extra.weight", None)


def test_fused_parameter_is_loaded_only_with_every_shard() -> None:
    block = Block()
    loaded = load_mapped_weights(block, [("gate_proj.weight", torch.ones(2, 4)), ("norm", torch.ones(4))], STACKED)
    assert loaded == {"norm"}
    both = [("up_proj.weight", torch.full((2, 4), 2.0)), ("gate_proj.weight", torch.ones(2, 4))]
    assert load_mapped_weights(block, both, STACKED) == {"gate_up_proj.weight"}
    assert block.gate_up_proj.weight[:2].eq(1).all() and block.gate_up_proj.weight[2:].eq(2).all()


def test_ignored_and_skipped_names_are_dropped_but_strays_are_listed() -> None:
    block = Block()
    weights = [
        ("rotary_emb.inv_freq", torch.ones(2)),
        ("lm_head.weight", torch.ones(2)),
        ("norm", torch.ones(4)),
        ("stray.weight", torch.ones(1)),
        ("other.bias", torch.ones(1)),
    ]
    with pytest.raises(ModelLoadError, match=r"\['other.bias', 'stray.weight'\]"):
        load_mapped_weights(
            block, weights, STACKED, ignored_suffixes=["rotary_emb.inv_freq"], skipped_names=["lm_head.weight"]
        )
