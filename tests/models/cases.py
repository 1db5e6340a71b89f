"""The parity cases of every architecture llmplug registers: tiny transformers configs, one or more per name.

A case's name is its test id; `architecture(case)` is the registered name it proves (the coverage
test requires one for every entry point of `llmplug.models`). TP_CASES: one case per family run
with tensor parallelism (slow).
"""

from __future__ import annotations

from transformers import (
    ApertusConfig,
    ArceeConfig,
    BioGptConfig,
    BertConfig,
    BloomConfig,
    CamembertConfig,
    CodeGenConfig,
    Data2VecTextConfig,
    CTRLConfig,
    Cohere2Config,
    CohereConfig,
    CwmConfig,
    Ernie4_5Config,
    ExaoneConfig,
    Exaone4Config,
    GlmConfig,
    Glm4Config,
    GraniteSWAConfig,
    HeliumConfig,
    HunYuanDenseV1Config,
    HyperCLOVAXConfig,
    InternLM3Config,
    IQuestCoderConfig,
    Jais2Config,
    MinistralConfig,
    Ministral3Config,
    SeedOssConfig,
    VaultGemmaConfig,
    FalconConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPTBigCodeConfig,
    GPTNeoConfig,
    GemmaConfig,
    GPT2Config,
    GPTJConfig,
    GPTNeoXConfig,
    GPTNeoXJapaneseConfig,
    GraniteConfig,
    GteConfig,
    LlamaConfig,
    MegatronBertConfig,
    MistralConfig,
    ModernBertDecoderConfig,
    ModernBertConfig,
    MptConfig,
    NanoChatConfig,
    OpenAIGPTConfig,
    NemotronConfig,
    NomicBertConfig,
    OlmoConfig,
    Olmo2Config,
    Olmo3Config,
    OPTConfig,
    PersimmonConfig,
    PhiConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    RobertaConfig,
    RobertaPreLayerNormConfig,
    SmolLM3Config,
    StableLmConfig,
    Starcoder2Config,
    XGLMConfig,
    XLMRobertaConfig,
    XLMRobertaXLConfig,
)

from llmplug.testing import ParityCase, PoolingParityCase, tiny_config

from .case_factory import NO_POSITION_LIMIT, case

WINDOW = 8  # sliding windows far shorter than prompt + generation (up to 29 + 24 tokens)

CASES: list[ParityCase] = [
    # the Llama family: biases, tying, q/k norm, explicit head_dim, scaled rope
    case("LlamaForCausalLM", LlamaConfig, attention_bias=True, mlp_bias=True),
    case("MistralForCausalLM", MistralConfig, head_dim=32, sliding_window=None),
    case("Qwen2ForCausalLM", Qwen2Config, tie_word_embeddings=True),
    case("Qwen3ForCausalLM", Qwen3Config, head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # RMSNorm 1 + w, GeGLU, sqrt(hidden) embedding scale
    case("GemmaForCausalLM", GemmaConfig, head_dim=16),
    # parallel residual with one LayerNorm, partial rotary, q/k LayerNorm, lm_head bias
    case("PhiForCausalLM", PhiConfig, partial_rotary_factor=0.5, qk_layernorm=True),
    # fused qkv_proj / gate_up_proj checkpoint tensors, partial rotary (Phi-4-mini)
    case("Phi3ForCausalLM", Phi3Config, partial_rotary_factor=0.75, tie_word_embeddings=False, sliding_window=WINDOW),
    # parallel residual with two norms, per-head interleaved fused qkv, partial rotary; and sequential
    case("GPTNeoXForCausalLM", GPTNeoXConfig, partial_rotary_factor=0.25),
    case("GPTNeoXForCausalLM-sequential", GPTNeoXConfig, use_parallel_residual=False, attention_bias=False),
    # interleaved (GPT-J style) partial rotary, parallel residual, lm_head bias
    case("GPTJForCausalLM", GPTJConfig, rotary_dim=8, n_inner=128),
    # learned positions, Conv1D weights, fused c_attn
    case("GPT2LMHeadModel", GPT2Config, n_inner=128),
    # learned positions at offset 2, ReLU
    case("OPTForCausalLM", OPTConfig, ffn_dim=128),
    # weightless LayerNorm, clip_qkv small enough to clip
    case("OlmoForCausalLM", OlmoConfig, clip_qkv=0.3),
    # post-sublayer norms, q/k RMSNorm over the whole projection
    case("Olmo2ForCausalLM", Olmo2Config),
    # embedding, residual, attention and logits multipliers
    case(
        "GraniteForCausalLM",
        GraniteConfig,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=4.0,
    ),
    # parallel residual, bias-free LayerNorm, interleaved rotary, per-head q/k LayerNorm weights, logit scale
    case("CohereForCausalLM", CohereConfig, use_qk_norm=True, logit_scale=0.5),
    # LayerNorm with bias, partial rotary, q/k/v bias; and the parallel-residual variant
    case("StableLmForCausalLM", StableLmConfig, partial_rotary_factor=0.25, use_qkv_bias=True),
    case("StableLmForCausalLM-parallel", StableLmConfig, use_parallel_residual=True),
    # plain GELU MLP with biases, LayerNorm, a window on every layer
    case("Starcoder2ForCausalLM", Starcoder2Config, sliding_window=WINDOW),
    # sinusoidal positions at offset 2, scaled embeddings
    case("XGLMForCausalLM", XGLMConfig, ffn_dim=128),
    # LayerNorm 1 + w, squared ReLU, partial rotary
    case("NemotronForCausalLM", NemotronConfig),
    # per-head interleaved fused qkv, q/k LayerNorm with bias, squared ReLU
    case("PersimmonForCausalLM", PersimmonConfig),
    # sandwich norms, attention and final logit soft-caps, query_pre_attn_scalar, alternating windows
    case(
        "Gemma2ForCausalLM",
        Gemma2Config,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=2.0,
    ),
    # Gemma 2 without soft-caps, q/k norms with 1 + w, a rope per layer type (local and global, scaled)
    case(
        "Gemma3ForCausalLM",
        Gemma3TextConfig,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        },
    ),
    # ALiBi, a LayerNorm after the embeddings, per-head fused qkv
    # (no context length in its config: the engine assumes 2048)
    case("BloomForCausalLM", BloomConfig),
    # parallel attention + MLP from one norm, multi-query (Falcon-7B)
    case("FalconForCausalLM", FalconConfig),
    # the new decoder architecture: two norms, grouped KV heads in the fused qkv (Falcon-40B)
    case("FalconForCausalLM-new", FalconConfig, new_decoder_architecture=True, num_kv_heads=2, bias=False),
    # ALiBi scaled with the scores, sequential layers, biases (Falcon-RW); transformers' eager Falcon adds
    # the ALiBi bias twice (once in its mask, once again in the scores), its SDPA path once
    case(
        "FalconForCausalLM-alibi",
        FalconConfig,
        hf_attn="sdpa",
        alibi=True,
        multi_query=False,
        parallel_attn=False,
        bias=True,
    ),
    # ALiBi, bias-free LayerNorm, clip_qkv (transformers' MPT ignores alibi_bias_max: keep its default 8)
    # (its context length is `max_seq_len`)
    case("MptForCausalLM", MptConfig, max_seq_len=256, attn_config={"alibi": True, "clip_qkv": 0.3}),
    # unscaled attention, learned positions, alternating global and local (windowed) layers
    case(
        "GPTNeoForCausalLM",
        GPTNeoConfig,
        attention_types=[[["global", "local"], 1]],
        window_size=WINDOW,
        intermediate_size=128,
    ),
    # NoPE: the second layer has no rotary
    case("SmolLM3ForCausalLM", SmolLM3Config, no_rope_layer_interval=2),
    # OLMo 2 with a window on the first layer and a rope per layer type
    case(
        "Olmo3ForCausalLM",
        Olmo3Config,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        },
    ),
]

CASES += [
    # config-only aliases transformers runs as Llama, under their hub class names; EXAONE 3 keeps its tensor
    # names, also when transformers re-saves it as LlamaForCausalLM
    case("ExaoneForCausalLM", ExaoneConfig, architecture="ExaoneForCausalLM"),
    case("LlamaForCausalLM-exaone", ExaoneConfig),
    case("InternLM3ForCausalLM", InternLM3Config, architecture="InternLM3ForCausalLM", head_dim=16,
         attention_bias=True, mlp_bias=True),
    case("IQuestCoderForCausalLM", IQuestCoderConfig, architecture="IQuestCoderForCausalLM", head_dim=16),
    # windows from layer_types (a window on the first layer only)
    case("MinistralForCausalLM", MinistralConfig, head_dim=16, sliding_window=WINDOW,
         layer_types=["sliding_attention", "full_attention"]),
    case("CwmForCausalLM", CwmConfig, bos_token_id=0, head_dim=16, sliding_window=WINDOW,
         layer_types=["full_attention", "sliding_attention"]),
    # yarn rope and the query scale 1 + beta * log(1 + floor(p / 8)): > 1 from position 8 on
    case("Ministral3ForCausalLM", Ministral3Config, head_dim=16, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8,
        "llama_4_scaling_beta": 0.5}),
    # plain squared-ReLU MLP; and with LayerNorm and biases
    case("ArceeForCausalLM", ArceeConfig, attention_bias=True, mlp_bias=True),
    case("Jais2ForCausalLM", Jais2Config),
    # xIELU (learned), q/k RMSNorm, llama3 rope
    case("ApertusForCausalLM", ApertusConfig),
    case("SeedOssForCausalLM", SeedOssConfig, head_dim=16, attention_bias=True, attention_out_bias=True,
         mlp_bias=True),
    # interleaved rotary, biases everywhere, tied
    case("Ernie4_5ForCausalLM", Ernie4_5Config, head_dim=16, use_bias=True),
    # q/k norms after rotary, NTK-alpha rope
    case("HunYuanDenseV1ForCausalLM", HunYuanDenseV1Config, head_dim=16, attention_bias=True,
         rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}),
    case("HeliumForCausalLM", HeliumConfig, head_dim=16, attention_bias=True, mlp_bias=True),
    # fused gate_up, interleaved rotary over half of each head; GLM-4: sandwich norms
    case("GlmForCausalLM", GlmConfig, head_dim=16),
    case("Glm4ForCausalLM", Glm4Config, head_dim=16),
    # post-sublayer norms, q/k norms, a windowed layer with rotary and a global one without
    case("Exaone4ForCausalLM", Exaone4Config, sliding_window=WINDOW, sliding_window_pattern=2),
    # parallel residual, interleaved rotary on the windowed layer only, logit scale
    case("Cohere2ForCausalLM", Cohere2Config, sliding_window=WINDOW, logit_scale=0.5,
         layer_types=["sliding_attention", "full_attention"]),
    # Gemma 2 without the post-sublayer norms
    case("VaultGemmaForCausalLM", VaultGemmaConfig, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
         attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
         layer_types=["sliding_attention", "full_attention"]),
    # Granite multipliers + a window, sinks, and a layer without rotary (layer_rope_theta 0)
    case("GraniteSWAForCausalLM", GraniteSWAConfig, sliding_window=WINDOW,
         layer_types=["sliding_attention", "full_attention"], layer_rope_theta=[10000.0, 0],
         embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
    # Granite multipliers (logits multiplied) + Peri-LN norms after each sublayer; and without them
    case("HyperCLOVAXForCausalLM", HyperCLOVAXConfig, embedding_multiplier=2.0, residual_multiplier=0.5,
         attention_multiplier=0.1, logits_scaling=0.5),
    case("HyperCLOVAXForCausalLM-no-post-norm", HyperCLOVAXConfig, use_post_norm=False, logits_scaling=0.5),
    # GPT-J with q/k/v fused in CodeGen's four-block layout (4 heads: one per block)
    case("CodeGenForCausalLM", CodeGenConfig, rotary_dim=8, n_inner=128),
    # GPT-2 on plain linear weights with one KV head; and q/k/v per head
    case("GPTBigCodeForCausalLM", GPTBigCodeConfig, n_inner=128),
    case("GPTBigCodeForCausalLM-mha", GPTBigCodeConfig, n_inner=128, multi_query=False),
    # weightless RMSNorm (also after the embeddings), inverted rotary, q/k norms after it, soft-capped logits
    case("NanoChatForCausalLM", NanoChatConfig, final_logit_softcapping=2.0),
    # the Transformer paper's sinusoidal positions, sqrt(d) embeddings, a tied head with a bias
    case("CTRLLMHeadModel", CTRLConfig, dff=128),
    # post-LN (a norm after each residual add), no final norm
    case("OpenAIGPTLMHeadModel", OpenAIGPTConfig),
    # OPT-350m: post-LN and embeddings narrower than the layers, projected in and out
    case("OPTForCausalLM-350m", OPTConfig, ffn_dim=128, do_layer_norm_before=False, word_embed_proj_dim=32),
    # fairseq layer, sqrt(d) embeddings, positions at offset 2
    case("BioGptForCausalLM", BioGptConfig),
    # StableLM 2 12B: a bias-free LayerNorm per q and k head, stored as one tensor per head
    case("StableLmForCausalLM-qk-layernorm", StableLmConfig, qk_layernorm=True, partial_rotary_factor=0.25),
    # sequential GPT-NeoX without biases but the last layer's attention output bias, partial rotary
    case("GPTNeoXJapaneseForCausalLM", GPTNeoXJapaneseConfig, intermediate_multiple_size=2, rotary_pct=0.5),
    # no norm before the first layer's attention, a window of 8 (local_attention 16) with its own rope base,
    # fused GeGLU, the prediction head (dense with bias, GELU, LayerNorm) before the tied decoder with a bias
    case("ModernBertDecoderForCausalLM", ModernBertDecoderConfig, local_attention=2 * WINDOW, classifier_bias=True,
         pad_token_id=0, bos_token_id=0),
    # the BERT family as causal LMs: post-LN, token types, the masked-LM prediction head before a tied decoder
    # with a bias; RoBERTa's positions from pad_token_id + 1 and GELU head (BERT's follows hidden_act)
    case("BertLMHeadModel", BertConfig, is_decoder=True, hidden_act="relu"),
    case("RobertaForCausalLM", RobertaConfig, is_decoder=True, pad_token_id=1, hf_position_offset=2),
    case("XLMRobertaForCausalLM", XLMRobertaConfig, is_decoder=True, pad_token_id=1, hf_position_offset=2),
    case("CamembertForCausalLM", CamembertConfig, is_decoder=True, pad_token_id=1, hf_position_offset=2),
    case("Data2VecTextForCausalLM", Data2VecTextConfig, is_decoder=True, pad_token_id=1, hf_position_offset=2),
    # pre-LN relatives: a norm before each sublayer and after the last; embeddings normalized, or not
    case("RobertaPreLayerNormForCausalLM", RobertaPreLayerNormConfig, is_decoder=True, pad_token_id=1,
         hf_position_offset=2),
    case("XLMRobertaXLForCausalLM", XLMRobertaXLConfig, is_decoder=True, pad_token_id=1, hf_position_offset=2),
    case("MegatronBertForCausalLM", MegatronBertConfig, is_decoder=True, hidden_act="relu"),
    # LongRoPE: the long factors (and attention factor) for sequences past the original context of 2
    case("Phi3ForCausalLM-longrope", Phi3Config, prompt_lengths=(3, 11, 7, 20, 4, 14, 29, 5),
         partial_rotary_factor=0.75, original_max_position_embeddings=2, rope_parameters={
             "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
             "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}),
]

# one case per family module, the one whose blocks shard the most ways (q/k norms, ALiBi slopes, 1 KV head)
TP_CASES: list[str] = [
    "LlamaForCausalLM",
    "Gemma3ForCausalLM",
    "PhiForCausalLM",
    "GPTNeoXForCausalLM",
    "GPTJForCausalLM",
    "GPT2LMHeadModel",
    "OPTForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "CohereForCausalLM",
    "StableLmForCausalLM-parallel",
    "Starcoder2ForCausalLM",
    "XGLMForCausalLM",
    "NemotronForCausalLM",
    "PersimmonForCausalLM",
    "BloomForCausalLM",
    "FalconForCausalLM",
    "MptForCausalLM",
    "GPTNeoForCausalLM",
]
# pipeline parallelism (PP=2, one layer per stage) where a stage boundary meets a family's structure:
# positions and a tied head on different stages, sandwich norms, post-sublayer norms
PP_CASES: list[str] = ["GPT2LMHeadModel", "Gemma2ForCausalLM", "Olmo2ForCausalLM"]


def pooling_case(
    name: str, config_class: type, engine_kwargs: dict | None = None, token_types: bool = False, **fields
) -> PoolingParityCase:
    """A PoolingParityCase over `tiny_config(config_class, architectures=[its architecture], **fields)`."""
    architecture_name = name.split("-")[0]
    make = lambda: tiny_config(config_class, architectures=[architecture_name], **fields)  # noqa: E731
    return PoolingParityCase(name, make, engine_kwargs=engine_kwargs or {}, token_types=token_types)


EMBEDDER = {"runner": "pooling"}  # a causal LM run as an embedding model (model.convert: embed)

# every pooling architecture: each encoder family as an embedder and as a classifier, decoder classifiers
POOLING_CASES: list[PoolingParityCase] = [
    # post-LN encoder, learned positions, token types; CLS pooling; the classifier on text pairs
    pooling_case("BertModel", BertConfig),
    pooling_case("BertForSequenceClassification", BertConfig, token_types=True, num_labels=3),
    pooling_case("BertForSequenceClassification-one-label", BertConfig, token_types=True, num_labels=1),
    # positions from pad_token_id + 1, a dense + tanh classification head
    pooling_case("RobertaModel", RobertaConfig, pad_token_id=1),
    pooling_case("RobertaForSequenceClassification", RobertaConfig, pad_token_id=1, num_labels=2),
    pooling_case("XLMRobertaModel", XLMRobertaConfig, pad_token_id=1),
    pooling_case("XLMRobertaForSequenceClassification", XLMRobertaConfig, pad_token_id=1, num_labels=1),
    # pre-norm, fused Wqkv and GeGLU, rotary per layer type, bidirectional local windows of 2 keys each way;
    # the classifier's head norm over the mean of the tokens
    pooling_case("ModernBertModel", ModernBertConfig, pad_token_id=0, local_attention=4, global_attn_every_n_layers=2),
    pooling_case(
        "ModernBertForSequenceClassification", ModernBertConfig, pad_token_id=0, local_attention=4,
        classifier_pooling="mean", num_labels=2,
    ),
    # rotary post-LN encoders: SwiGLU without biases (mean pooling); GeGLU with a down_proj bias
    pooling_case("NomicBertModel", NomicBertConfig, pad_token_id=0),
    pooling_case("NomicBertForSequenceClassification", NomicBertConfig, token_types=True, pad_token_id=0, num_labels=2),
    pooling_case("GteModel", GteConfig, pad_token_id=0),
    pooling_case("GteForSequenceClassification", GteConfig, pad_token_id=0, type_vocab_size=0, num_labels=2),
    # decoders: a `score` head on the last token; and a causal LM as a last-token embedder
    pooling_case("LlamaForSequenceClassification", LlamaConfig, num_labels=1),
    pooling_case("MistralForSequenceClassification", MistralConfig, sliding_window=None, num_labels=2),
    pooling_case("Qwen2ForSequenceClassification", Qwen2Config, num_labels=2),
    pooling_case("Qwen3ForSequenceClassification", Qwen3Config, head_dim=32, num_labels=3),
    pooling_case("Qwen3ForCausalLM-embed", Qwen3Config, EMBEDDER, head_dim=32),
]


def architecture(case: ParityCase | PoolingParityCase) -> str:
    """The registered architecture a case proves: its name up to the first '-'."""
    return case.name.split("-")[0]


# the mixture-of-experts and latent-attention architectures, in their own module (they use `case` above)
from .cases_moe import EP_CASES, MOE_CASES, MOE_TP_CASES  # noqa: E402

CASES += MOE_CASES
TP_CASES += MOE_TP_CASES

# the state-space and hybrid architectures, in their own module (they use `case` above)
from .cases_recurrent import RECURRENT_CASES, RECURRENT_PP_CASES, RECURRENT_TP_CASES  # noqa: E402

CASES += RECURRENT_CASES
TP_CASES += RECURRENT_TP_CASES
PP_CASES += RECURRENT_PP_CASES
