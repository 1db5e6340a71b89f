"""Qwen3-VL (`Qwen3VLForConditionalGeneration`): Qwen2-VL's family (plugins/models/qwen2_vl.py) with a Qwen3
decoder (q/k norms) whose M-RoPE is interleaved (layers/mrope.py), Qwen3-VL's vision tower (learned positions,
LayerNorm, a GELU-tanh MLP: its data in layers/vision/qwen_vit.py) and deepstack.

Deepstack: the tower also returns the states after its `deepstack_visual_indexes` layers, each folded by its own
merger (norm after the fold); the decoder adds deepstack row i to the image's tokens after its layer i. An image's
encoder output is therefore [tokens, (1 + deepstack layers) * hidden] — the placeholders' input rows, then one
row per deepstack layer — which the model runner slices per chunk and splits (engine/encoder_cache.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.decoder.arch import DecoderArchConfig
from llmplug.layers.decoder.model import LayerRows
from llmplug.layers.vision import PatchMerger, qwen_vit_config
from llmplug.plugins.models.llama import Qwen3ForCausalLM, qwen3_arch_config
from llmplug.plugins.models.llava import maybe_prefix
from llmplug.plugins.models.qwen2_vl import Qwen2VLForConditionalGeneration

__all__ = ["Qwen3VLForConditionalGeneration"]

DEFAULT_MROPE_SECTION = (24, 20, 20)  # transformers' when the text config names none


def qwen3_vl_text_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen3's decoder with interleaved M-RoPE on every layer (transformers' Qwen3-VL text rotary interleaves
    whatever `mrope_interleaved` says)."""
    arch = qwen3_arch_config(hf)
    section = tuple(int(n) for n in (hf.rope_parameters or {}).get("mrope_section") or DEFAULT_MROPE_SECTION)
    layers = tuple(dataclasses.replace(layer, rope=dataclasses.replace(layer.rope, mrope_section=section,
                                                                        mrope_interleaved=True))
                   for layer in arch.layers)
    return dataclasses.replace(arch, layers=layers)


class Qwen3VLTextForCausalLM(Qwen3ForCausalLM):
    """Qwen3-VL's language model: Qwen3 with interleaved M-RoPE."""

    arch_config_of = staticmethod(qwen3_vl_text_arch_config)


class DeepstackMergers(nn.ModuleList):
    """One `PatchMerger` (norm after the fold) per deepstack layer (transformers' `deepstack_merger_list`)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load `<i>.norm.*`, `<i>.linear_fc1.*`, `<i>.linear_fc2.*`; returns the loaded names."""
        by_merger: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in weights:
            index, rest = name.split(".", 1)
            by_merger.setdefault(int(index), []).append((rest, tensor))
        return {f"{i}.{name}" for i, part in by_merger.items() for name in self[i].load_weights(part)}


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen3-VL: Qwen2-VL's delegation and positions, Qwen3-VL's tower, and deepstack rows for the decoder."""

    language_models = {"qwen3_vl_text": Qwen3VLTextForCausalLM}
    checkpoint_prefixes = {
        **Qwen2VLForConditionalGeneration.checkpoint_prefixes,
        "model.visual.deepstack_merger_list.": ("deepstack_mergers", ""),
        "visual.deepstack_merger_list.": ("deepstack_mergers", ""),
    }

    def build_vision(self, config: PretrainedConfig, prefix: str) -> tuple[nn.Module, nn.Module]:
        """Qwen2-VL's tower and merger, and the deepstack layers' mergers."""
        tower, merger = super().build_vision(config, prefix)
        vision = qwen_vit_config(config.vision_config)
        self.deepstack_mergers = DeepstackMergers(
            PatchMerger(vision.hidden_size, vision.out_hidden_size, vision.spatial_merge_size, vision.norm,
                        prefix=maybe_prefix(prefix, f"deepstack_mergers.{i}"), norm_after_fold=True)
            for i in range(len(vision.deepstack_visual_indexes)))
        return tower, merger

    @property
    def deepstack_layers(self) -> int:
        """Decoder layers after which image rows are added: each image row is this many + 1 rows wide."""
        return len(self.deepstack_mergers)

    def embed_multimodal(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                         **_: Any) -> list[torch.Tensor]:
        """pixel_values [patches, C * T * P * P] and image_grid_thw [1, 3] of one image -> one [patches / merge**2,
        (1 + deepstack_layers) * hidden] tensor: its placeholders' input rows, then each deepstack layer's."""
        states, deepstack = self.vision_tower(pixel_values, image_grid_thw)
        rows = [self.multi_modal_projector(states)]
        rows += [merger(layer_states) for merger, layer_states in zip(self.deepstack_mergers, deepstack)]
        return [torch.cat(rows, dim=-1)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None, added_rows: LayerRows | None = None) -> torch.Tensor:
        """input_ids, positions [3, T] -> hidden states [T, hidden]; the runner puts the image rows in
        `inputs_embeds` and their deepstack rows in `added_rows`."""
        return self.language_model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds,
                                   added_rows=added_rows)
