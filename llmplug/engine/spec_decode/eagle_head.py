"""EAGLE and EAGLE-3 draft heads for the Llama family: their checkpoint formats, built from llmplug.layers blocks.

EAGLE-1 (checkpoint names `fc.*`, `layers.N.*`): at position p the head reads x = fc([embedding(t_{p+1}) |
h_p]), h_p the target's last hidden state (after its final norm), through Llama decoder layers whose first
has no input norm; its output stream (no norm) goes through the target's lm_head and is the h of the next
draft position.

EAGLE-3 (`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`): the target's hidden
states of three layers (low, middle, high: the inputs of the layers `eagle_aux_hidden_state_layer_ids`,
by default 2, L // 2 and L - 3) are concatenated and reduced by fc to one h; the midlayer's attention reads
[input_layernorm(embedding) | hidden_norm(h)] (twice the hidden features) with h as the residual; the
stream before the final norm is the next draft position's h, the normed one goes through the head's own
lm_head over a draft vocabulary, whose token i is the target's token i + d2t[i].

Both read the target's token embedding unless the checkpoint has its own `embed_tokens.weight`.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from transformers import LlamaConfig

from llmplug.core.errors import ConfigError, ModelLoadError
from llmplug.layers.decoder.arch import DecoderArchConfig
from llmplug.layers.decoder.attention import DecoderAttention
from llmplug.layers.decoder.layer import DecoderLayer
from llmplug.layers.decoder.mlp import DecoderMLP
from llmplug.layers.decoder.model import stacked_params
from llmplug.layers.layernorm import make_norm
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.rotary import RotaryEmbedding, get_rope
from llmplug.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmplug.layers.weight_utils import load_mapped_weights
from llmplug.loaders.weights import find_weight_files, weights_iterator
from llmplug.plugins.models.llama import llama_arch_config

EagleMethod = Literal["eagle", "eagle3"]
UNUSED_NAMES = ("t2d",)  # EAGLE-3's target -> draft vocabulary mask: drafting needs only d2t


@dataclass(frozen=True, slots=True)
class EagleHeadConfig:
    """A head checkpoint's config.json (a LlamaConfig) as the head needs it."""

    method: EagleMethod
    arch: DecoderArchConfig  # the head's decoder layer(s)
    target_hidden_size: int  # features of each target hidden state it reads
    draft_vocab_size: int  # rows of its own lm_head (EAGLE-3)
    aux_layer_ids: tuple[int, ...]  # EAGLE-3: the target layers whose inputs it reads
    fc_bias: bool  # some EAGLE-1 checkpoints have one


def eagle_head_config(path: Path, method: EagleMethod, target_num_layers: int, names: set[str]) -> EagleHeadConfig:
    """Read the head's config.json; `names` are the checkpoint's tensor names (fc's bias is one or not)."""
    hf = LlamaConfig(**json.loads((path / "config.json").read_text()))
    arch = llama_arch_config(hf)
    if method == "eagle":  # EAGLE's first layer reads fc's output as it is
        layers = (dataclasses.replace(arch.layers[0], input_norm=False), *arch.layers[1:])
    else:
        if hf.num_hidden_layers != 1:
            raise ConfigError(f"an EAGLE-3 head has one midlayer; {path}/config.json has {hf.num_hidden_layers} layers")
        layers = (dataclasses.replace(arch.layers[0], attention_input_size=2 * hf.hidden_size),)
    L = target_num_layers
    aux = tuple(getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or (2, L // 2, L - 3))
    if method == "eagle3" and not all(0 < i < L for i in aux):
        raise ConfigError(f"EAGLE-3 reads the inputs of target layers {aux}: the target has {L} layers (0..{L - 1}); "
                          "set eagle_aux_hidden_state_layer_ids in the head's config.json")
    return EagleHeadConfig(
        method, dataclasses.replace(arch, layers=layers, num_layers=len(layers)),
        int(getattr(hf, "target_hidden_size", None) or hf.hidden_size),
        int(getattr(hf, "draft_vocab_size", None) or hf.vocab_size), aux, "fc.bias" in names,
    )


def _rotary(arch: DecoderArchConfig, min_positions: int) -> RotaryEmbedding:
    """The head's rotary table, long enough for the target's positions (a head's config may say fewer)."""
    rope = arch.layers[0].rope
    return get_rope(arch.head_dim, arch.rotary_dim(rope), max(rope.max_position, min_positions), rope.theta,
                    rope.scaling, rope.is_neox_style, rope.inverted)


class EagleHead(nn.Module, metaclass=abc.ABCMeta):
    """What both heads share: the optional own embedding, one draft step's interface, weight loading."""

    def __init__(self, config: EagleHeadConfig, own_embedding: bool, target_positions: int) -> None:
        super().__init__()
        self.config = config
        arch = config.arch
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, "embed_tokens") if (
            own_embedding) else None
        self.rotary = _rotary(arch, target_positions)

    def reduce(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states [T, n * target_hidden] -> the h the first draft step reads [T, hidden]."""
        return target_hidden

    @abc.abstractmethod
    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeddings of t_{p+1} [T, hidden], p [T], h_p [T, hidden] -> (what the lm_head reads, the next h)."""

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load the checkpoint's tensors; a missing or unknown one is a ModelLoadError."""
        loaded = load_mapped_weights(self, weights.items(), stacked_params(self.config.arch), (), UNUSED_NAMES)
        missing = sorted(set(dict(self.named_parameters())) - loaded)
        if missing:
            raise ModelLoadError(f"the {self.config.method} head checkpoint has no weights for {missing}")


class Eagle1Head(EagleHead):
    """EAGLE-1: fc over [embedding | target hidden], Llama decoder layers, the target's lm_head."""

    def __init__(self, config: EagleHeadConfig, own_embedding: bool, target_positions: int) -> None:
        super().__init__(config, own_embedding, target_positions)
        arch = config.arch
        self.fc = ReplicatedLinear(arch.hidden_size + config.target_hidden_size, arch.hidden_size, config.fc_bias, "fc")
        self.layers = nn.ModuleList(DecoderLayer(arch, layer, f"layers.{i}") for i, layer in enumerate(arch.layers))

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.fc(torch.cat((embeds, hidden), dim=-1)), None  # [T, hidden]
        rope = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rope)
        out = x + residual
        return out, out


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over [norm(embedding) | norm'(h)], h the residual, then the MLP."""

    def __init__(self, arch: DecoderArchConfig, prefix: str) -> None:
        super().__init__()
        size = arch.hidden_size
        self.input_layernorm = make_norm(arch.norm, size)
        self.hidden_norm = make_norm(arch.norm, size)
        self.self_attn = DecoderAttention(arch, arch.layers[0], f"{prefix}.self_attn")
        self.post_attention_layernorm = make_norm(arch.norm, size)
        self.mlp = DecoderMLP(arch.mlp, size, arch.intermediate_size, f"{prefix}.mlp")

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (MLP output, residual stream) [T, hidden] each."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)  # [T, 2 * hidden]
        x, residual = self.post_attention_layernorm(self.self_attn(x, rope), hidden.clone())
        return self.mlp(x), residual


class Eagle3Head(EagleHead):
    """EAGLE-3: fc over three target layers' hidden states, the midlayer, its own norm and draft-vocabulary head."""

    def __init__(self, config: EagleHeadConfig, own_embedding: bool, target_positions: int) -> None:
        super().__init__(config, own_embedding, target_positions)
        arch = config.arch
        width = len(config.aux_layer_ids) * config.target_hidden_size
        self.fc = ReplicatedLinear(width, arch.hidden_size, config.fc_bias, "fc")
        self.midlayer = Eagle3Layer(arch, "midlayer")
        self.norm = make_norm(arch.norm, arch.hidden_size)
        self.lm_head = ParallelLMHead(config.draft_vocab_size, arch.hidden_size, False, "lm_head")
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # draft id -> offset

    def reduce(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(target_hidden)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.midlayer(embeds, hidden, self.rotary.cos_sin(positions, hidden.dtype))
        normed, stream = self.norm(x, residual)
        return normed, stream

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax over the draft vocabulary [N, hidden] -> target token ids [N]."""
        ids = self.lm_head.get_logits(hidden).argmax(dim=-1)
        return ids + self.d2t[ids]

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if "d2t" not in weights:
            raise ModelLoadError("the eagle3 head checkpoint has no d2t (draft -> target vocabulary offsets)")
        self.d2t.copy_(weights.pop("d2t"))
        super().load_weights(weights)


def load_eagle_head(path: str, method: EagleMethod, target_num_layers: int, target_positions: int,
                    device: torch.device, dtype: torch.dtype) -> EagleHead:
    """Build the head of the checkpoint folder `path` in `dtype` on `device` and load its weights (its rotary
    table covering the target's `target_positions`)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"speculative_config.model={path!r}: an EAGLE head is a folder with config.json and weights")
    files, kind = find_weight_files(folder)
    weights = dict(weights_iterator(files, kind))
    config = eagle_head_config(folder, method, target_num_layers, set(weights))
    cls = Eagle1Head if method == "eagle" else Eagle3Head
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            head = cls(config, "embed_tokens.weight" in weights, target_positions)
        finally:
            torch.set_default_dtype(previous)
    head.load_weights(weights)
    return head.eval()
