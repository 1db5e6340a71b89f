"""The generic decoder's structure: parameter names per norm placement, and a tied head with its own bias."""

from __future__ import annotations

import dataclasses

import torch
from transformers import PretrainedConfig

from llmplug.layers.decoder import DecoderArchConfig, DecoderForCausalLM, LayerConfig, MLPConfig
from llmplug.layers.layernorm import NormConfig

BASE = DecoderArchConfig(
    architecture="Tiny",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    layers=(LayerConfig(None),),
)


def build(**changes) -> DecoderForCausalLM:
    arch = dataclasses.replace(BASE, **changes)

    class Tiny(DecoderForCausalLM):
        arch_config_of = staticmethod(lambda hf: arch)

    return Tiny(config=PretrainedConfig())


def layer_norms(model: DecoderForCausalLM) -> list[str]:
    return sorted(
        {n.split(".")[3] for n, _ in model.named_parameters() if n.startswith("model.layers.0.") and "norm" in n}
    )


def test_norm_placements_use_transformers_names() -> None:
    assert layer_norms(build()) == ["input_layernorm", "post_attention_layernorm"]
    sandwich = [
        "input_layernorm",
        "post_attention_layernorm",
        "post_feedforward_layernorm",
        "pre_feedforward_layernorm",
    ]
    assert layer_norms(build(post_norm=True)) == sandwich
    assert layer_norms(build(pre_norm=False, post_norm=True)) == [
        "post_attention_layernorm",
        "post_feedforward_layernorm",
    ]
    assert layer_norms(build(parallel_residual=True)) == ["input_layernorm"]
    assert layer_norms(build(parallel_residual=True, parallel_mlp_norm=True)) == [
        "input_layernorm",
        "post_attention_layernorm",
    ]


def test_plain_mlp_and_model_level_names() -> None:
    names = {
        n
        for n, _ in build(
            mlp=MLPConfig("gelu", gated=False, bias=True),
            absolute_positions="learned",
            max_position=16,
            embedding_norm=True,
            norm=NormConfig("layer", bias=True),
        ).named_parameters()
    }
    assert {
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.bias",
        "model.embed_positions.weight",
        "model.embed_norm.bias",
        "model.norm.weight",
        "lm_head.weight",
    } <= names
    assert not any("gate" in n for n in names)


def test_a_tied_head_with_a_bias_shares_the_table_and_loads_its_own_bias() -> None:
    model = build(tie_word_embeddings=True, lm_head_bias=True)
    table, bias = torch.randn(10, 8), torch.randn(10)
    weights = {
        n: torch.randn(p.shape) for n, p in model.named_parameters() if "qkv_proj" not in n and "gate_up" not in n
    }
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    weights |= {
        attn + "q_proj.weight": torch.randn(8, 8),
        attn + "k_proj.weight": torch.randn(4, 8),
        attn + "v_proj.weight": torch.randn(4, 8),
        mlp + "gate_proj.weight": torch.randn(16, 8),
        mlp + "up_proj.weight": torch.randn(16, 8),
    }
    weights |= {"model.embed_tokens.weight": table, "lm_head.bias": bias}
    loaded = model.load_weights(weights.items())
    assert "lm_head.bias" in loaded and model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(3, 8)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ table.T + bias)
