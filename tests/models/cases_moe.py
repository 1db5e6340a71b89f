"""Parity cases of the mixture-of-experts and latent-attention architectures (joined into cases.CASES).

Experts are few and small (4-8 experts of 32 features), routers pick 2; each case switches on what
its family routes or stores differently, so that a wrong flag changes the tokens.
"""

from __future__ import annotations

from transformers import (
    DbrxConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Dots1Config,
    Ernie4_5_MoeConfig,
    FlexOlmoConfig,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    GptOssConfig,
    GraniteMoeConfig,
    GraniteMoeSharedConfig,
    GraniteMoeSWAConfig,
    HunYuanMoEV1Config,
    JetMoeConfig,
    Llama4TextConfig,
    MiniCPM3Config,
    MiniMaxM2Config,
    MixtralConfig,
    OlmoeConfig,
    PhimoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    SolarOpenConfig,
    YoutuConfig,
)

from .cases import case

WINDOW = 8
# DeepSeek V3's router: sigmoid + correction bias, 2 of 4 groups, renormalised, scaled; a dense first layer
DEEPSEEK_V3_MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
)
DEEPSEEK_V2_MOE = DEEPSEEK_V3_MOE | {"norm_topk_prob": False}
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
GRANITE_MULTIPLIERS = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0)

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
    # a dense first layer (mlp_only_layers), a gated shared expert, top-4 without renormalising
    case(
        "Qwen2MoeForCausalLM",
        Qwen2MoeConfig,
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
    ),
    # q/k norms, renormalised top-2, a dense second layer (decoder_sparse_step)
    case(
        "Qwen3MoeForCausalLM",
        Qwen3MoeConfig,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    # RMSNorm over the whole q and k projections, top-2 as scored
    case("OlmoeForCausalLM", OlmoeConfig, num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    # OLMo 2's post-sublayer norms with OLMoE's experts
    case("FlexOlmoForCausalLM", FlexOlmoConfig, num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    # Granite's multipliers, stacked experts (input_linear / output_linear)
    case("GraniteMoeForCausalLM", GraniteMoeConfig, num_local_experts=4, intermediate_size=32, **GRANITE_MULTIPLIERS),
    # + an ungated shared MLP
    case(
        "GraniteMoeSharedForCausalLM",
        GraniteMoeSharedConfig,
        num_local_experts=4,
        intermediate_size=32,
        shared_intermediate_size=48,
        **GRANITE_MULTIPLIERS,
    ),
    # + sinks, a windowed layer, a rope base per layer and a NoPE layer
    case(
        "GraniteMoeSWAForCausalLM",
        GraniteMoeSWAConfig,
        num_local_experts=4,
        intermediate_size=32,
        shared_intermediate_size=48,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        layer_rope_theta=[10000.0, 0],
        **GRANITE_MULTIPLIERS,
    ),
    # sinks, biases, alternating windows, yarn; router bias, clamped SwiGLU with biases, interleaved gate/up
    case(
        "GptOssForCausalLM",
        GptOssConfig,
        head_dim=16,
        num_local_experts=4,
        intermediate_size=32,
        sliding_window=WINDOW,
        swiglu_limit=0.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
    # partial rotary, q/k/v bias without o_proj's, per-head q/k norms, DeepSeek V3 routing
    case("Glm4MoeForCausalLM", Glm4MoeConfig, attention_bias=True, use_qk_norm=True, **DEEPSEEK_V3_MOE),
    # Qwen3 attention with DeepSeek V3 routing
    case("Dots1ForCausalLM", Dots1Config, **DEEPSEEK_V3_MOE),
    # q/k norms over the projections, partial rotary, sigmoid routing with the block's correction bias
    case(
        "MiniMaxM2ForCausalLM",
        MiniMaxM2Config,
        head_dim=16,
        num_local_experts=8,
        intermediate_size=32,
        partial_rotary_factor=0.5,
    ),
    # interleaved rotary, biases everywhere, a dense first layer, softmax routing with the correction bias
    case(
        "Ernie4_5_MoeForCausalLM",
        Ernie4_5_MoeConfig,
        moe_num_experts=8,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=1,
        use_bias=True,
    ),
    # fused Wqkv clamped, bias-free LayerNorm, flat expert tensors, weights divided by their 2-norm
    case(
        "DbrxForCausalLM",
        DbrxConfig,
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 0.3},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2, "moe_normalize_expert_weights": 2.0},
    ),
    # latent attention with a q LoRA, YaRN with mscale, interleaved rotary; V2 group-limited softmax routing
    case(
        "DeepseekV2ForCausalLM",
        DeepseekV2Config,
        num_key_value_heads=4,  # transformers expands the latent to every head
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        topk_method="group_limited_greedy",
        rope_parameters=DEEPSEEK_YARN,
        **DEEPSEEK_V2_MOE,
    ),
    # latent attention without a q LoRA, V3 routing, rotate-half rotary (rope_interleave off)
    case(
        "DeepseekV3ForCausalLM",
        DeepseekV3Config,
        num_key_value_heads=4,  # transformers expands the latent to every head
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        rope_interleave=False,
        **DEEPSEEK_V3_MOE,
    ),
    # latent attention with rotate-half rotary and a dense MLP; embedding, residual and logits scalings
    case(
        "MiniCPM3ForCausalLM",
        MiniCPM3Config,
        num_key_value_heads=4,  # transformers expands the latent to every head
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        scale_emb=4.0,
        scale_depth=1.4,
        dim_model_base=32,
    ),
    # DeepSeek V3 with its MoE layers by type: the dense one last, interleaved rotary, a q LoRA
    case(
        "Glm4MoeLiteForCausalLM",
        Glm4MoeLiteConfig,
        num_key_value_heads=4,  # transformers expands the latent to every head
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        mlp_layer_types=["sparse", "dense"],
        **DEEPSEEK_V3_MOE | {"first_k_dense_replace": None},
    ),
    # latent attention with interleaved rotary in the Llama decoder, a dense MLP, latent biases
    case(
        "YoutuForCausalLM",
        YoutuConfig,
        num_key_value_heads=4,  # transformers expands the latent to every head
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        attention_bias=True,
    ),
    # Llama attention with q/k/v biases, DeepSeek V3 routing on every layer
    case("SolarOpenForCausalLM", SolarOpenConfig, head_dim=16, attention_bias=True, **DEEPSEEK_V3_MOE),
    # q/k norms after the rotary, a shared MLP beside the experts, float32 router
    case("HunYuanMoEV1ForCausalLM", HunYuanMoEV1Config, head_dim=16, num_experts=4, moe_topk=2, intermediate_size=32),
    # routed query / output projections over shared k/v (mixture of attention), MoE MLP, both with output biases
    case(
        "JetMoeForCausalLM",
        JetMoeConfig,
        num_key_value_heads=2,
        kv_channels=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        tie_word_embeddings=False,
    ),
    # layer 0: interleaved rotary, L2 q/k norm, chunked local attention (chunks of 8), dense MLP;
    # layer 1: NoPE with attention temperature tuning, sigmoid top-1 experts on their input + a shared expert
    case(
        "Llama4ForCausalLM",
        Llama4TextConfig,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size=32,
        intermediate_size_mlp=96,
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 0],
        attention_chunk_size=WINDOW,
        floor_scale=4,
        attn_scale=0.5,
    ),
]

# one case per family module: experts sharded by their intermediate features, heads of latent attention
# sharded with the latent replicated; and what each family shards beside them (expert and router biases,
# sinks, q/k norms over whole projections, shared experts, fused Wqkv, a q LoRA)
MOE_TP_CASES = [
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "GptOssForCausalLM",
    "Glm4MoeForCausalLM",
    "MiniMaxM2ForCausalLM",
    "Ernie4_5_MoeForCausalLM",
    "HunYuanMoEV1ForCausalLM",
    "DbrxForCausalLM",
    "DeepseekV3ForCausalLM",
    "MiniCPM3ForCausalLM",
    "JetMoeForCausalLM",
    "Llama4ForCausalLM",
]
# expert parallelism: TP=2 ranks holding 4 of the 8 experts each, a sharded shared expert beside them
EP_CASES = ["Qwen2MoeForCausalLM"]
