"""The norm, activation, position and q/k-norm blocks of llmplug.layers against transformers' own modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import ModernBertDecoderConfig
from transformers.activations import ACT2FN, XIELUActivation
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.ctrl.modeling_ctrl import positional_encoding
from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale
from transformers.models.modernbert_decoder.modeling_modernbert_decoder import ModernBertDecoderPredictionHead
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
from transformers.models.olmo.modeling_olmo import OlmoLayerNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.stablelm.modeling_stablelm import StableLmLayerNormPerHead
from transformers.models.xglm.modeling_xglm import XGLMSinusoidalPositionalEmbedding

from llmplug.layers.activation import ACTIVATIONS, XIELU, Activation, ActivationAndMul
from llmplug.layers.checkpoint_names import CheckpointNames, HeadLayout
from llmplug.layers.decoder import DecoderArchConfig, DecoderModel, HeadTransformConfig, LayerConfig
from llmplug.layers.decoder.model import HeadTransform
from llmplug.layers.layernorm import LayerNorm, NormConfig, RMSNorm, make_norm
from llmplug.layers.position_embedding import LearnedPositionEmbedding, sinusoidal_table
from llmplug.layers.qk_norm import QKNormConfig, ShardedHeadsNorm, make_qk_norm

H = 16


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3 + (1.0 if p.dim() else 0.0))
    return module


def copy_params(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            dict(ours.named_parameters())[name].copy_(p)


@pytest.mark.parametrize(
    "config, reference",
    [
        (NormConfig("layer", 1e-5, bias=True), lambda: torch.nn.LayerNorm(H, eps=1e-5)),
        (NormConfig("layer", 1e-5), lambda: CohereLayerNorm(H, eps=1e-5)),  # no bias
        (NormConfig("layer", 1e-5, has_weight=False), lambda: OlmoLayerNorm(H)),  # no weight, no bias
        (NormConfig("layer", 1e-5, bias=True, weight_offset=1.0), lambda: NemotronLayerNorm1P(H, eps=1e-5)),
        (NormConfig("rms", 1e-6, weight_offset=1.0), lambda: GemmaRMSNorm(H, eps=1e-6)),
        (NormConfig("rms", 1e-5), lambda: Olmo2RMSNorm(H, eps=1e-5)),
    ],
    ids=["layernorm", "layernorm-no-bias", "weightless", "layernorm1p", "gemma-rms", "rms"],
)
def test_each_norm_variant_matches_transformers_and_fuses_the_residual_add(config, reference) -> None:
    theirs = randomized(reference())
    ours = make_norm(config, H)
    copy_params(ours, theirs)
    x, residual = torch.randn(5, H), torch.randn(5, H)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))
        out, stream = ours(x.clone(), residual)
        torch.testing.assert_close(stream, x + residual)
        torch.testing.assert_close(out, theirs(x + residual))


def test_weightless_rms_norm_and_the_names_of_norm_parameters() -> None:
    norm = RMSNorm(H, 1e-6, has_weight=False)
    x = torch.randn(3, H)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert [n for n, _ in norm.named_parameters()] == []
    assert [n for n, _ in LayerNorm(H, bias=True).named_parameters()] == ["weight", "bias"]
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        make_norm(NormConfig("rms", bias=True), H)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_every_activation_matches_transformers_plain_and_gated(name: str) -> None:
    x = torch.randn(4, 2 * H) * 3
    reference = ACT2FN[name]
    torch.testing.assert_close(Activation(name)(x), reference(x), atol=1e-6, rtol=1e-5)
    gate, up = x[:, :H].contiguous(), x[:, H:]  # transformers' gate is its own projection's (contiguous) output
    torch.testing.assert_close(ActivationAndMul(name)(x), reference(gate) * up, atol=1e-6, rtol=1e-5)


def test_an_unknown_activation_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="activation 'gelu_13' is not supported; supported: .*'relu2'"):
        Activation("gelu_13")


def test_xielu_matches_transformers_with_loaded_parameters() -> None:
    theirs = XIELUActivation(alpha_p_init=0.6, alpha_n_init=0.9, beta=0.4, eps=-1e-5, dtype=torch.float32)
    ours = XIELU()
    for name, tensor in theirs.state_dict().items():
        getattr(ours, name).weight_loader(getattr(ours, name), tensor)
    x = torch.randn(64) * 4
    torch.testing.assert_close(ours(x), theirs(x))


def test_sinusoidal_table_is_xglms_and_learned_positions_read_their_offset_row() -> None:
    xglm = XGLMSinusoidalPositionalEmbedding(num_positions=40, embedding_dim=H, padding_idx=1)
    positions = torch.arange(30)
    expected = xglm(positions[None], 0)[0]  # XGLM adds its offset 2 itself
    torch.testing.assert_close(sinusoidal_table(42, H)[positions + 2], expected)
    learned = LearnedPositionEmbedding(10, 4, offset=2)
    table = torch.randn(12, 4)
    learned.weight_loader(learned.weight, table)
    torch.testing.assert_close(learned(torch.tensor([0, 9])), table[[2, 11]])


def test_paper_sinusoidal_table_is_ctrls() -> None:
    torch.testing.assert_close(sinusoidal_table(50, H, paper_frequencies=True), positional_encoding(50, H, torch.float))


def test_query_position_scale_is_ministral3s_llama4_attention_temperature() -> None:
    arch = DecoderArchConfig(
        architecture="X", vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1,
        num_kv_heads=1, head_dim=4, layers=(LayerConfig(None),), query_position_scale=(0.3, 8),
    )
    positions = torch.tensor([0, 7, 8, 15, 16, 100, 1000])
    ours = DecoderModel(arch)._query_scale(positions, torch.float32)  # [T, 1, 1]
    theirs = get_llama_4_attn_scale(positions[None], 0.3, 8)  # [1, 1, T, 1]
    torch.testing.assert_close(ours.flatten(), theirs.flatten())
    assert ours[0].item() == 1.0 and ours[-1].item() > 1.0


@pytest.mark.parametrize("bias", [True, False])
def test_head_transform_is_modernbert_decoders_prediction_head(bias: bool) -> None:
    config = ModernBertDecoderConfig(hidden_size=H, classifier_bias=bias, classifier_activation="gelu", norm_bias=True)
    theirs = randomized(ModernBertDecoderPredictionHead(config))
    arch = DecoderArchConfig(
        architecture="X", vocab_size=8, hidden_size=H, intermediate_size=8, num_layers=1, num_heads=1,
        num_kv_heads=1, head_dim=H, layers=(LayerConfig(None),), norm=NormConfig("layer", config.norm_eps, bias=True),
        head_transform=HeadTransformConfig("gelu", bias),
    )
    ours = HeadTransform(arch)
    copy_params(ours, theirs)
    assert (ours.dense.bias is not None) == bias
    x = torch.randn(5, H)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))


def test_stablelm_per_head_norms_load_stacked_into_one_per_head_norm() -> None:
    heads, d = 4, 8
    theirs = randomized(StableLmLayerNormPerHead(d, heads, eps=1e-5))
    names = CheckpointNames(stacked={"q_layernorm.norms": "q_norm"})
    tensors = {f"q_layernorm.{name}": p.data for name, p in theirs.named_parameters()}
    ((name, stacked),) = names.translate(tensors.items(), HeadLayout(heads, heads, d))
    ours = ShardedHeadsNorm(QKNormConfig(NormConfig("layer", 1e-5), scope="per_head"), heads, d, first_head=0)
    ours.weight_loader(ours.weight, stacked)
    x = torch.randn(3, heads, d)
    with torch.no_grad():
        expected = theirs(x.transpose(0, 1)[None])[0].transpose(0, 1)  # theirs: [1, heads, T, d]
        torch.testing.assert_close(ours(x), expected)
    assert name == "q_norm.weight"


def test_per_head_qk_norm_matches_coheres_and_loads_its_rank_heads() -> None:
    heads, d = 4, 8
    theirs = randomized(CohereLayerNorm((heads, d), eps=1e-5))
    config = QKNormConfig(NormConfig("layer", 1e-5), scope="per_head")
    x = torch.randn(3, heads, d)
    whole = ShardedHeadsNorm(config, heads, d, first_head=0)
    whole.weight_loader(whole.weight, theirs.weight.data)
    with torch.no_grad():
        torch.testing.assert_close(whole(x), theirs(x))
    second_half = ShardedHeadsNorm(config, 2, d, first_head=2)  # rank 1 of 2
    second_half.weight_loader(second_half.weight, theirs.weight.data)
    with torch.no_grad():
        torch.testing.assert_close(second_half(x[:, 2:]), theirs(x)[:, 2:])


def test_projection_qk_norm_normalizes_all_heads_at_once_like_olmo2() -> None:
    heads, d = 4, 8
    theirs = randomized(Olmo2RMSNorm(heads * d, eps=1e-5))
    ours = make_qk_norm(QKNormConfig(NormConfig("rms", 1e-5), scope="projection"), heads, d, 0)
    ours.weight_loader(ours.weight, theirs.weight.data)
    x = torch.randn(3, heads * d)
    with torch.no_grad():
        torch.testing.assert_close(ours(x.view(3, heads, d)).reshape(3, -1), theirs(x))


def test_head_scope_qk_norm_is_a_plain_norm_over_head_dim() -> None:
    norm = make_qk_norm(QKNormConfig(NormConfig("rms", 1e-6)), 4, 8, 0)
    assert isinstance(norm, RMSNorm) and norm.hidden_size == 8
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-6))


def test_a_qk_norm_scope_the_norm_cannot_serve_is_refused() -> None:
    with pytest.raises(ValueError, match="scope 'projection' is not implemented"):
        ShardedHeadsNorm(QKNormConfig(NormConfig("layer"), scope="projection"), 4, 8, 0)
