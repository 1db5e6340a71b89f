"""The Attention layer's feature arguments: checked at construction, stored under their API names, the
sinks loaded as a weight, ALiBi slopes as transformers computes them, and a backend that does not
implement a feature refusing the layer at bind time instead of ignoring it."""

from __future__ import annotations

import pytest
import torch

from llmplug.communicators.parallel_state import (
    DistributedEnv,
    destroy_distributed_environment,
    init_distributed_environment,
    initialize_model_parallel,
)
from llmplug.core.errors import ModelLoadError
from llmplug.layers.attention import Attention, AttentionBackend, alibi_slopes, bind_kv_cache
from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.weight_utils import load_mapped_weights
from tests.communicators.ranks import run_ranks

D = 8


def test_features_are_stored_under_their_api_names() -> None:
    slopes = alibi_slopes(4)
    layer = Attention(4, D, 0.5, 2, prefix="m.attn", sliding_window=16, logit_softcap=50.0, alibi_slopes=slopes,
                      use_sinks=True)
    assert layer.sliding_window == 16 and layer.logit_softcap == 50.0
    assert torch.equal(layer.alibi_slopes, slopes) and layer.alibi_slopes.dtype == torch.float32
    assert layer.sinks.shape == (4,) and layer.sinks.dtype == torch.float32
    assert layer.features == {"sliding_window", "logit_softcap", "alibi", "sinks"}
    plain = Attention(4, D, 0.5, 2)
    assert plain.sliding_window is None and plain.logit_softcap is None
    assert plain.alibi_slopes is None and plain.sinks is None and plain.features == frozenset()


def test_only_sinks_are_a_checkpoint_weight_and_slopes_follow_the_module() -> None:
    layer = Attention(4, D, 0.5, alibi_slopes=alibi_slopes(4), use_sinks=True)
    assert set(layer.state_dict()) == {"sinks"}
    assert layer.to(torch.device("meta")).alibi_slopes.device.type == "meta"


@pytest.mark.parametrize("kwargs, field", [
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(sliding_window=4.5), "sliding_window=4.5"),
    (dict(logit_softcap=0.0), "logit_softcap=0.0"),
    (dict(alibi_slopes=torch.ones(3)), r"alibi_slopes has shape \(3,\), expected \(4,\)"),
    (dict(values_in_keys=D + 1), "values_in_keys=9"),
    (dict(values_in_keys=4), "values_in_keys=4 .* one KV head"),  # 4 KV heads here
])
def test_bad_feature_values_are_errors_naming_the_layer_and_argument(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        Attention(4, D, 0.5, prefix="model.layers.2.self_attn.attn", **kwargs)
    assert "model.layers.2.self_attn.attn" in str(info.value)
    assert Attention(4, D, 0.5, sliding_window=4, logit_softcap=30.0).features == {"sliding_window", "logit_softcap"}


def test_sinks_load_through_their_weight_loader() -> None:
    model = torch.nn.Module()
    model.attn = Attention(4, D, 0.5, use_sinks=True)
    sinks = torch.randn(4, dtype=torch.bfloat16)
    assert load_mapped_weights(model, [("attn.sinks", sinks)]) == {"attn.sinks"}
    assert torch.equal(model.attn.sinks, sinks.float())
    with pytest.raises(ModelLoadError, match=r"attn\.sinks.*sinks has shape \(8,\)"):
        load_mapped_weights(model, [("attn.sinks", torch.zeros(8))])
    load_mapped_weights(model, [("attn.sinks", -sinks)])  # a good checkpoint still loads after the bad one
    assert torch.equal(model.attn.sinks, -sinks.float())


def _sinks_loaded_by_this_rank() -> list[float]:
    """In each of 2 tensor-parallel ranks: a layer of 2 of the model's 4 heads loads the checkpoint's 4 sinks."""
    init_distributed_environment(DistributedEnv.from_environ())
    initialize_model_parallel(tp=2, pp=1, dp=1)
    model = torch.nn.Module()
    model.attn = Attention(2, D, 0.5, use_sinks=True)
    load_mapped_weights(model, [("attn.sinks", torch.tensor([0.5, 1.5, 2.5, 3.5]))])
    destroy_distributed_environment()
    return model.attn.sinks.tolist()


def test_each_tensor_parallel_rank_loads_the_sinks_of_its_heads() -> None:
    assert run_ranks(_sinks_loaded_by_this_rank, world_size=2) == [[0.5, 1.5], [2.5, 3.5]]


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 8, 12, 16, 20, 32, 40, 48, 64, 71, 112])
def test_alibi_slopes_equal_bloom_and_mpt(heads: int) -> None:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    torch.testing.assert_close(alibi_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu")), rtol=1e-6, atol=0)
    for max_bias in (8.0, 16.0, 4.0):
        mpt = -build_mpt_alibi_tensor(heads, 2, max_bias)[:, 0, 0]  # slope * (position 0 - position 1)
        torch.testing.assert_close(alibi_slopes(heads, max_bias), mpt, rtol=1e-6, atol=0)


class PlainOnlyBackend(TorchSDPABackend):
    """A backend written before attention features existed: it implements none of them."""

    name = "plain_only"
    supported_features = AttentionBackend.supported_features


def test_a_backend_refuses_layers_with_features_it_does_not_implement() -> None:
    model = torch.nn.Sequential(Attention(2, D, 1.0, prefix="a"), Attention(2, D, 1.0, prefix="b", logit_softcap=30.0))
    with pytest.raises(ValueError, match=r"'plain_only' does not implement \['logit_softcap'\].*layer 'b'"):
        bind_kv_cache(model, None, PlainOnlyBackend)
    assert bind_kv_cache(model[:1], None, PlainOnlyBackend) == 1  # a plain layer binds to it
    assert bind_kv_cache(model, None, TorchSDPABackend) == 2 and model[1].backend is TorchSDPABackend


def test_a_latent_layer_takes_no_v_and_its_cache_holds_keys_only() -> None:
    layer = Attention(4, D, 0.5, 1, prefix="m.attn", values_in_keys=5)
    assert layer.features == {"values_in_keys"} and layer.v_head_dim == 5
    assert TorchSDPABackend.layer_kv_cache_shape(layer, 3, 4) == (1, 1, 3, 4, D)
    assert TorchSDPABackend.layer_kv_cache_shape(Attention(4, D, 0.5, 2), 3, 4) == (2, 2, 3, 4, D)
    bind_kv_cache(layer, None, TorchSDPABackend)
    with pytest.raises(ValueError, match="values_in_keys=5"):
        layer(torch.zeros(2, 4 * D), torch.zeros(2, D), torch.zeros(2, D))


def test_the_triton_backend_refuses_a_latent_layer_naming_the_feature() -> None:
    from llmplug.layers.attention.triton_backend import TritonAttentionBackend

    layer = Attention(4, D, 0.5, 1, prefix="m.attn", values_in_keys=5)
    with pytest.raises(ValueError, match=r"does not implement \['values_in_keys'\].*layer 'm.attn'"):
        bind_kv_cache(layer, None, TritonAttentionBackend)
