"""The HF-config readers of the adapters, and adapters refusing what the decoder does not model."""

from __future__ import annotations

import pytest
from transformers import (
    BertConfig,
    CTRLConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MptConfig,
    OpenAIGPTConfig,
    Qwen2Config,
    RobertaConfig,
    SmolLM3Config,
    StableLmConfig,
    Zamba2Config,
)

from llmplug.core.errors import ModelLoadError
from llmplug.layers.decoder import DecoderArchConfig, LayerConfig
from llmplug.plugins.models.arch_config import layers_of, rope_config_of
from llmplug.plugins.models.bert import BertLMHeadModel, RobertaForCausalLM
from llmplug.plugins.models.ctrl import CTRLLMHeadModel
from llmplug.plugins.models.gemma import Gemma2ForCausalLM
from llmplug.plugins.models.gpt2 import GPT2LMHeadModel
from llmplug.plugins.models.llama import LlamaForCausalLM, SmolLM3ForCausalLM
from llmplug.plugins.models.mpt import MptForCausalLM
from llmplug.plugins.models.openai_gpt import OpenAIGPTLMHeadModel
from llmplug.plugins.models.zamba2 import Zamba2ForCausalLM
from llmplug.testing import tiny_config


def test_layer_types_give_windows_and_each_type_its_rope() -> None:
    hf = tiny_config(
        Gemma3TextConfig,
        num_hidden_layers=3,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )
    local, _, full = layers_of(hf)
    assert (local.sliding_window, local.rope.theta, local.rope.scaling) == (8, 10000.0, None)
    assert (full.sliding_window, full.rope.theta, dict(full.rope.scaling)) == (
        None,
        1e6,
        {"rope_type": "linear", "factor": 8.0},
    )


def test_a_window_without_layer_types_covers_every_layer_and_qwen2_follows_use_sliding_window() -> None:
    windows = lambda hf: [layer.sliding_window for layer in layers_of(hf)]  # noqa: E731
    assert windows(tiny_config(LlamaConfig)) == [None, None]
    assert windows(tiny_config(Gemma2Config, sliding_window=8)) == [8, None]  # Gemma 2 alternates
    assert windows(tiny_config(Qwen2Config, sliding_window=8)) == [None, None]  # use_sliding_window off
    on = tiny_config(Qwen2Config, sliding_window=8, use_sliding_window=True, max_window_layers=1)
    assert windows(on) == [None, 8]


def test_nope_layers_and_configs_without_rotary() -> None:
    arch = SmolLM3ForCausalLM.arch_config_of(tiny_config(SmolLM3Config, no_rope_layer_interval=2))
    assert [layer.rope is not None for layer in arch.layers] == [True, False]
    assert all(layer.rope is None for layer in GPT2LMHeadModel.arch_config_of(tiny_config(GPT2Config)).layers)


def test_per_layer_type_rope_is_not_read_as_one_rope() -> None:
    hf = tiny_config(Gemma3TextConfig)
    with pytest.raises(ModelLoadError, match="per layer type .*read them with layers_of"):
        rope_config_of(hf)


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")  # the old spelling, on purpose
def test_partial_rotary_and_rope_scaling_are_read_from_either_transformers_generation() -> None:
    hf = tiny_config(StableLmConfig, partial_rotary_factor=0.25)
    assert rope_config_of(hf).partial_rotary_factor == 0.25
    legacy = tiny_config(LlamaConfig)
    legacy.rope_parameters = None
    legacy.rope_theta, legacy.rope_scaling = 5e5, {"rope_type": "linear", "factor": 2.0}
    rope = rope_config_of(legacy)
    assert (rope.theta, dict(rope.scaling)) == (5e5, {"rope_type": "linear", "factor": 2.0})


@pytest.mark.parametrize(
    "cls, hf, field",
    [
        (GPT2LMHeadModel, lambda: tiny_config(GPT2Config, scale_attn_by_inverse_layer_idx=True), "inverse_layer_idx"),
        (OpenAIGPTLMHeadModel, lambda: tiny_config(OpenAIGPTConfig, afn="tanh"), "afn='tanh'"),
        (CTRLLMHeadModel, lambda: tiny_config(CTRLConfig, layer_norm_epsilon=1e-5), "layer_norm_epsilon"),
        (MptForCausalLM, lambda: tiny_config(MptConfig, attn_config={"qk_ln": True}), "qk_ln"),
        (Gemma2ForCausalLM, lambda: tiny_config(Gemma2Config, use_bidirectional_attention=True), "bidirectional"),
        (BertLMHeadModel, lambda: tiny_config(BertConfig), "is_decoder=False"),
        (
            RobertaForCausalLM,
            lambda: tiny_config(RobertaConfig, is_decoder=True, add_cross_attention=True, pad_token_id=1),
            "add_cross_attention=True",
        ),
    ],
)
def test_what_the_decoder_does_not_model_is_a_clear_load_error(cls, hf, field: str) -> None:
    config = hf()
    config.architectures = [cls.__name__]  # as a saved checkpoint's config.json has it
    with pytest.raises(ModelLoadError, match=f"{cls.__name__}: .*{field}.* is not supported"):
        cls.arch_config_of(config)


def test_the_arch_config_refuses_contradictions() -> None:
    layers = (LayerConfig(None),)
    base = dict(
        architecture="X",
        vocab_size=8,
        hidden_size=4,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=4,
    )
    with pytest.raises(ValueError, match="2 layer configs for 1 layers"):
        DecoderArchConfig(**base, layers=layers * 2)
    with pytest.raises(ValueError, match="parallel_mlp_norm needs parallel_residual"):
        DecoderArchConfig(**base, layers=layers, parallel_mlp_norm=True)
    with pytest.raises(ValueError, match="needs pre_norm, post_norm, both, or norm_after_residual"):
        DecoderArchConfig(**base, layers=layers, pre_norm=False)
    with pytest.raises(ValueError, match="norm_after_residual replaces pre_norm"):
        DecoderArchConfig(**base, layers=layers, norm_after_residual=True)
    with pytest.raises(ValueError, match="absolute positions need max_position"):
        DecoderArchConfig(**base, layers=layers, absolute_positions="learned")
    post_norm_error = "layer 0: a post-norm layer is attention \\+ MLP in a pre-norm model"
    with pytest.raises(ValueError, match=post_norm_error):
        DecoderArchConfig(**base, layers=(LayerConfig(None, post_norm=True),), pre_norm=False, post_norm=True)
    with pytest.raises(ValueError, match=post_norm_error):
        DecoderArchConfig(**base, layers=(LayerConfig(None, mlp=False, post_norm=True),))
    assert DecoderArchConfig(**base, layers=(LayerConfig(None, post_norm=True),)).layers[0].post_norm
    assert LlamaForCausalLM.arch_config_of(tiny_config(LlamaConfig)).scale == 16**-0.5


def test_zamba2_refuses_attention_adapters_with_grouped_kv_heads() -> None:
    # transformers' k/v adapters are as wide as the queries: only one kv head per head fits them
    layers = dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_headdim=16)
    config = tiny_config(Zamba2Config, use_shared_attention_adapter=True, num_key_value_heads=2, **layers)
    config.architectures = ["Zamba2ForCausalLM"]
    with pytest.raises(ModelLoadError, match="Zamba2ForCausalLM: use_shared_attention_adapter with fewer kv heads"):
        Zamba2ForCausalLM(config=config)
