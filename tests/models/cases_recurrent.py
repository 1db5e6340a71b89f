"""Parity cases of the state-space and hybrid architectures (joined into cases.CASES).

Recurrent layers are small (8-16 channels per head, states of 8, a conv of 4) and their chunked scans
use chunks shorter than the prompts, so that chunked prefill, carried states and padding are all
exercised; the hybrids mix each layer kind at least once, and their MoE variants use 4 experts, top 2.
"""

from __future__ import annotations

from transformers import (
    BambaConfig,
    FalconH1Config,
    FalconMambaConfig,
    GraniteMoeHybridConfig,
    JambaConfig,
    LaraMiniConfig,
    Lfm2Config,
    Lfm2MoeConfig,
    Mamba2Config,
    MambaConfig,
    NemotronHConfig,
    OlmoHybridConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Zamba2Config,
)

from .case_factory import NO_POSITION_LIMIT, case

MAMBA2_SIZES = dict(num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=8, chunk_size=8)
BAMBA_SIZES = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8)
GDN_SIZES = dict(
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=16,
)
MOE_SIZES = dict(num_experts=4, num_experts_per_tok=2)
LFM2_LAYERS = dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3)
GRANITE_HYBRID = dict(layer_types=["mamba", "attention"], shared_intermediate_size=96, **BAMBA_SIZES)
# transformers saves the q, k, v convs by cutting the conv in three equal parts: q, k and v equally wide
OLMO_HYBRID = {k: v for k, v in GDN_SIZES.items() if k != "head_dim"} | dict(
    linear_key_head_dim=16, linear_value_head_dim=8
)
ZAMBA2 = dict(
    num_hidden_layers=5,
    layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
    num_mem_blocks=2,
    mamba_headdim=16,
    mamba_ngroups=2,
    mamba_d_state=8,
    adapter_rank=4,
    chunk_size=8,
)

RECURRENT_CASES = [
    # state-space models: Mamba (selective scan), FalconMamba (+ RMS norms of dt, B, C), Mamba 2 (SSD)
    case("MambaForCausalLM", MambaConfig, NO_POSITION_LIMIT, state_size=8, time_step_rank=8),
    case("FalconMambaForCausalLM", FalconMambaConfig, NO_POSITION_LIMIT, state_size=8, time_step_rank=8),
    case("Mamba2ForCausalLM", Mamba2Config, NO_POSITION_LIMIT, **MAMBA2_SIZES),
    # short convs and attention with q/k norms (LFM2, its final norm named embedding_norm)
    case("Lfm2ForCausalLM", Lfm2Config, block_multiple_of=32, block_ffn_dim_multiplier=1.5, **LFM2_LAYERS),
    # ... with sigmoid-scored experts chosen with a correction bias after a dense first layer (LFM2-MoE)
    case(
        "Lfm2MoeForCausalLM",
        Lfm2MoeConfig,
        num_dense_layers=1,
        moe_intermediate_size=32,
        routed_scaling_factor=1.5,
        **MOE_SIZES,
        **LFM2_LAYERS,
    ),
    # Mamba 2 and attention with partial rotary (Bamba)
    case("BambaForCausalLM", BambaConfig, attn_layer_indices=[1], **BAMBA_SIZES),
    # Bamba's mix with Granite's multipliers and no rotary (Granite 4.0 H Micro: no routed experts)
    case(
        "GraniteMoeHybridForCausalLM",
        GraniteMoeHybridConfig,
        num_local_experts=0,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=4.0,
        **GRANITE_HYBRID,
    ),
    # routed experts plus the shared MLP, and rotary (Granite 4.0 H Tiny / Small)
    case(
        "GraniteMoeHybridForCausalLM-moe",
        GraniteMoeHybridConfig,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        position_embedding_type="rope",
        **GRANITE_HYBRID,
    ),
    # attention and Mamba 2 side by side in every layer, muP multipliers everywhere (Falcon-H1); with the
    # gated norm (norm before gate) and without it
    case(
        "FalconH1ForCausalLM",
        FalconH1Config,
        mamba_d_ssm=128,
        mamba_rms_norm=True,
        embedding_multiplier=1.5,
        lm_head_multiplier=0.5,
        mlp_multipliers=[0.8, 1.3],
        key_multiplier=0.7,
        attention_in_multiplier=1.2,
        attention_out_multiplier=0.9,
        ssm_in_multiplier=1.1,
        ssm_out_multiplier=0.6,
        ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7],
        **BAMBA_SIZES,
    ),
    case("FalconH1ForCausalLM-ungated", FalconH1Config, mamba_d_ssm=128, mamba_rms_norm=False, **BAMBA_SIZES),
    # Mamba 2 layers and two transformer blocks shared by three hybrid layers, with per-use adapters on q, k, v
    # and the MLP, on [hidden | embeddings] (Zamba 2; transformers' k/v adapters need as many kv heads as
    # heads); with rotary and grouped kv heads, without the attention adapters
    case("Zamba2ForCausalLM", Zamba2Config, use_shared_attention_adapter=True, num_key_value_heads=4, **ZAMBA2),
    case("Zamba2ForCausalLM-rope", Zamba2Config, use_mem_rope=True, hidden_act="silu", **ZAMBA2),
    # one sublayer per layer: Mamba 2, attention without rotary, squared-ReLU MLP (NemotronH)
    case(
        "NemotronHForCausalLM",
        NemotronHConfig,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        chunk_size=8,
    ),
    # gated delta nets (grouped value heads, projections interleaved per key head) and gated attention with
    # partial rotary and 1 + w norms (Qwen3-Next: experts with a gated shared expert, one dense layer;
    # Qwen3.5 with plain projections, dense and MoE)
    case(
        "Qwen3NextForCausalLM",
        Qwen3NextConfig,
        mlp_only_layers=[1],
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        **MOE_SIZES,
        **GDN_SIZES,
    ),
    case("Qwen3NextForCausalLM-dense", Qwen3NextConfig, mlp_only_layers=[0, 1, 2], **GDN_SIZES),
    case("Qwen3_5ForCausalLM", Qwen3_5TextConfig, **GDN_SIZES),
    case(
        "Qwen3_5MoeForCausalLM",
        Qwen3_5MoeTextConfig,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        **MOE_SIZES,
        **GDN_SIZES,
    ),
    # Qwen3.5's mix with a fused delta-net projection, windowed attention with rotary and full attention
    # without, experts with an ungated shared expert on every layer (Lara Mini)
    case(
        "LaraMiniForCausalLM",
        LaraMiniConfig,
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
        num_hidden_layers=4,
        sliding_window=8,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        **MOE_SIZES,
    ),
    # pre-norm delta-net layers (separate projections, beta doubled) beside post-norm OLMo 3 attention layers
    # (OLMo hybrid); with rotary, and without it (its released checkpoints) and with plain beta
    case("OlmoHybridForCausalLM", OlmoHybridConfig, **OLMO_HYBRID),
    case("OlmoHybridForCausalLM-nope", OlmoHybridConfig, rope_parameters=None, linear_allow_neg_eigval=False,
         **OLMO_HYBRID),
    # Mamba with RMS-normed dt, B, C and attention without rotary; experts on every other layer (Jamba)
    case(
        "JambaForCausalLM",
        JambaConfig,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        mamba_d_state=8,
        mamba_dt_rank=8,
        **MOE_SIZES,
    ),
    case("JambaForCausalLM-dense", JambaConfig, num_experts=1, attn_layer_period=2, attn_layer_offset=1,
         mamba_d_state=8, mamba_dt_rank=8),
]

# the recurrent mixers are replicated over tensor-parallel ranks and built per pipeline stage
RECURRENT_TP_CASES = ["BambaForCausalLM"]
RECURRENT_PP_CASES = ["Qwen3NextForCausalLM-dense"]
