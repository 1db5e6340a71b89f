"""Recurrent token mixers (state-space and linear attention) and their per-request state.

Exports the mixers (`MambaMixer`, `Mamba2Mixer`, `GatedDeltaNet`, `ShortConv`) with their configs,
their base `RecurrentMixer`, the state cache (`allocate_state_cache`, `bind_state_cache`,
`recurrent_layers`, `state_bytes_per_slot`) and the per-step `RecurrentMetadata`
(`build_recurrent_metadata`). The ops (causal_conv, selective_scan, ssd, gated_delta_rule) are
torch reference implementations, vectorized over requests and chunked over tokens.
"""

from llmplug.layers.recurrent.gated_delta_net import GatedDeltaNet, GatedDeltaNetConfig
from llmplug.layers.recurrent.mamba import MambaMixer, MambaMixerConfig
from llmplug.layers.recurrent.mamba2 import Mamba2Mixer, Mamba2MixerConfig
from llmplug.layers.recurrent.metadata import RecurrentMetadata, build_recurrent_metadata
from llmplug.layers.recurrent.short_conv import ShortConv, ShortConvConfig
from llmplug.layers.recurrent.state import (
    RecurrentMixer,
    StateShape,
    allocate_state_cache,
    bind_state_cache,
    recurrent_layers,
    state_bytes_per_slot,
)

__all__ = [
    "GatedDeltaNet",
    "GatedDeltaNetConfig",
    "Mamba2Mixer",
    "Mamba2MixerConfig",
    "MambaMixer",
    "MambaMixerConfig",
    "ShortConv",
    "ShortConvConfig",
    "RecurrentMetadata",
    "RecurrentMixer",
    "StateShape",
    "allocate_state_cache",
    "bind_state_cache",
    "build_recurrent_metadata",
    "recurrent_layers",
    "state_bytes_per_slot",
]
