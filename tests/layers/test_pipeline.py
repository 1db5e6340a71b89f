"""Pipeline stages as a model sees them: which layers a stage holds, and which weights it skips."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmplug.layers.pipeline import PPMissingLayer, pp_layer_range, skip_missing_layers


@pytest.mark.parametrize(
    "num_layers,pp_size,expected",
    [
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 4)]),
        (3, 2, [(0, 2), (2, 3)]),  # the extra layer goes to the stage before the last
        (7, 4, [(0, 2), (2, 4), (4, 6), (6, 7)]),
        (5, 5, [(i, i + 1) for i in range(5)]),
    ],
)
def test_layers_split_evenly_with_the_remainder_before_the_last_stage(num_layers, pp_size, expected):
    ranges = [pp_layer_range(num_layers, rank, pp_size) for rank in range(pp_size)]
    assert ranges == expected


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        pp_layer_range(2, 0, 3)


def test_weights_of_missing_layers_are_skipped_and_others_kept():
    model = nn.Module()
    model.layers = nn.ModuleList([PPMissingLayer(), nn.Linear(2, 2)])
    model.head = PPMissingLayer()
    weights = [(name, torch.zeros(1)) for name in ("layers.0.w", "layers.1.weight", "layers.10.w", "head.weight")]
    assert [name for name, _ in skip_missing_layers(model, weights)] == ["layers.1.weight", "layers.10.w"]
