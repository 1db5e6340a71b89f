"""Example model plugin: a two-layer toy causal LM that implements VllmModelForTextGeneration.

Registered as `llmplug.models` "ToyForCausalLM". torch is imported here, at module level: the
registry imports this module only when the architecture is chosen, never while listing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

LLMPLUG_PLUGIN_API_VERSION = "1.0"


@dataclass(frozen=True, slots=True)
class ToyConfig:
    """The architecture's typed view of the HF config, read once."""

    vocab_size: int
    hidden_size: int

    @classmethod
    def from_hf(cls, hf_config: Any) -> ToyConfig:
        """Read the fields the toy needs from a transformers PretrainedConfig (or anything alike)."""
        return cls(vocab_size=int(hf_config.vocab_size), hidden_size=int(hf_config.hidden_size))


class ToyForCausalLM(nn.Module):
    """Embedding -> one linear + SiLU mixed with a position signal -> tied-free LM head."""

    def __init__(self, *, config: Any, prefix: str = "") -> None:
        super().__init__()
        self.config = ToyConfig.from_hf(config)
        self.prefix = prefix
        self.embed_tokens = nn.Embedding(self.config.vocab_size, self.config.hidden_size)
        self.proj = nn.Linear(self.config.hidden_size, self.config.hidden_size)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        hidden = hidden + positions.to(hidden.dtype).unsqueeze(-1) * 1e-3
        return nn.functional.silu(self.proj(hidden))

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor:
        """hidden_states: [num_sampled, hidden_size] -> float logits [num_sampled, vocab_size]."""
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors by exact parameter name; an unknown name is an error."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"ToyForCausalLM has no parameter {name!r}; it has {sorted(params)}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded
