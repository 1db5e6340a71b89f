"""Parity cases of the mixture-of-experts and latent-attention architectures (joined into cases.CASES).

Experts are few and small (4-8 experts of 32 features), routers pick 2; each case switches on what
its family routes or stores differently, so that a wrong flag changes the tokens.
"""

from __future__ import annotations

from transformers import MixtralConfig, PhimoeConfig

from .cases import case

WINDOW = 8

MOE_CASES = [
    # softmax top-2 renormalised, experts stored one by one (w1/w2/w3), a window on every layer
    case("MixtralForCausalLM", MixtralConfig, num_local_experts=4, intermediate_size=32, sliding_window=WINDOW),
    # sparsemixer routing, LayerNorm with bias, attention and lm_head biases
    case(
        "PhimoeForCausalLM",
        PhimoeConfig,
        num_local_experts=4,
        intermediate_size=32,
        attention_bias=True,
        lm_head_bias=True,
        router_jitter_noise=0.5,
    ),
]

# MoE: experts sharded over the ranks' intermediate features
MOE_TP_CASES = ["MixtralForCausalLM"]
