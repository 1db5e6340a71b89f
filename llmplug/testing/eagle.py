"""Random EAGLE / EAGLE-3 heads saved in the public checkpoint formats (tests and benchmarks; no hub here)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig

HEAD_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "max_position_embeddings", "rms_norm_eps")


def eagle_head_config(target: LlamaConfig, method: str, draft_vocab_size: int) -> LlamaConfig:
    """The head's config.json: the target's sizes and one layer, as the public EAGLE checkpoints have."""
    sizes = {k: getattr(target, k) for k in HEAD_SIZES}
    if method == "eagle3":
        extra = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft_vocab_size}
    else:
        extra = {"architectures": ["LlamaForCausalLM"]}
    return LlamaConfig(**sizes, num_hidden_layers=1, **extra)


def save_random_eagle_head(path: Path, target: LlamaConfig, method: str, draft_vocab_size: int = 100,
                           seed: int = 5) -> dict[str, torch.Tensor]:
    """Save a randomly initialised `method` head ("eagle" or "eagle3") for `target` into `path` (the tensor
    names and shapes of the public checkpoints: EAGLE-1's `fc` and `layers.0`, EAGLE-3's `fc`, `midlayer`,
    `norm`, `lm_head`, `d2t`, `t2d`); returns the tensors."""
    config = eagle_head_config(target, method, draft_vocab_size)
    H, I, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    norm = lambda: 1 + torch.randn(H, generator=g) * 0.1  # noqa: E731
    layer = "layers.0" if method == "eagle" else "midlayer"
    attn_in = H if method == "eagle" else 2 * H
    tensors = {
        f"{layer}.self_attn.q_proj.weight": rand(q, attn_in), f"{layer}.self_attn.k_proj.weight": rand(kv, attn_in),
        f"{layer}.self_attn.v_proj.weight": rand(kv, attn_in), f"{layer}.self_attn.o_proj.weight": rand(H, q),
        f"{layer}.mlp.gate_proj.weight": rand(I, H), f"{layer}.mlp.up_proj.weight": rand(I, H),
        f"{layer}.mlp.down_proj.weight": rand(H, I), f"{layer}.post_attention_layernorm.weight": norm(),
    }
    if method == "eagle":
        tensors |= {"fc.weight": rand(H, 2 * H), "fc.bias": rand(H)}
    else:
        kept = torch.randperm(config.vocab_size, generator=g)[:draft_vocab_size].sort().values
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[kept] = True
        tensors |= {
            "fc.weight": rand(H, 3 * H), f"{layer}.input_layernorm.weight": norm(),
            f"{layer}.hidden_norm.weight": norm(), "norm.weight": norm(), "lm_head.weight": rand(draft_vocab_size, H),
            "d2t": kept - torch.arange(draft_vocab_size), "t2d": t2d,
        }
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    return tensors
