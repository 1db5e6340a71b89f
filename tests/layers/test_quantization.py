"""Weight-only int4: the kernel's dequantization, packing, staging through the layers' weight loaders,
and the per-call choice between the int4 copy and the dense weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llmplug.core.errors import ModelLoadError
from llmplug.layers.forward_context import GeneratedRows, forward_context
from llmplug.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from llmplug.layers.quantization import (
    DENSE,
    INT4_MAX_TOKENS,
    Int4Groups,
    Int4LinearMethod,
    LinearOptions,
    PackedInt4,
    attach_int4_groups,
    int4_kernel_supported,
    int4_rows_invariant,
    process_weights_after_loading,
    quantize_int4,
)
from llmplug.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(
    not int4_kernel_supported("cpu", torch.float32), reason="torch has no CPU int4 weight-only kernel here"
)
AUTO, FORCED = LinearOptions(), LinearOptions(quantize_dense=True, required=True)


def random_groups(n: int, k: int, planes: int = 1, group_size: int = 32, seed: int = 0) -> Int4Groups:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (planes, n, k), dtype=torch.uint8, generator=generator)
    scale = torch.rand(planes, n, k // group_size, generator=generator) * 0.1 + 0.01
    zero = torch.randn(planes, n, k // group_size, generator=generator) * 0.1
    return Int4Groups(q, scale, zero, group_size)


def exactly_representable(groups: Int4Groups) -> Int4Groups:
    """The same groups with scales and zeros rounded to bf16, so bf16 packing loses nothing."""
    return Int4Groups(groups.q, groups.scale.bfloat16().float(), groups.zero.bfloat16().float(), groups.group_size)


@pytest.mark.parametrize("planes", [1, 2])
def test_kernel_computes_x_times_q_minus_8_times_scale_plus_zero_in_fp32(planes: int) -> None:
    groups = random_groups(48, 128, planes)
    x = torch.randn(5, 128)
    packed = PackedInt4.pack(groups, torch.float32, torch.device("cpu"))
    expected = x.double() @ groups.dequantize().double().T
    torch.testing.assert_close(packed.matmul(x).double(), expected, rtol=1e-5, atol=1e-5)


def test_bf16_kernel_output_is_the_reference_rounded_once_to_bf16() -> None:
    groups = exactly_representable(random_groups(64, 256))
    x = torch.randn(3, 256).bfloat16()
    y = PackedInt4.pack(groups, torch.bfloat16, torch.device("cpu")).matmul(x)
    expected = x.double() @ groups.dequantize().double().T
    # accumulated in fp32: the only sizeable error is the final rounding to bf16 (half an ulp, 2^-9 relative)
    assert ((y.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-3).all()


def test_quantize_int4_error_is_at_most_half_a_step_per_group() -> None:
    weight = torch.randn(32, 128)
    groups = quantize_int4(weight, group_size=32)
    step = groups.scale[0].repeat_interleave(32, dim=-1)
    assert ((groups.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    assert groups.q.max() == 15 and groups.q.min() == 0


def test_quantize_int4_keeps_constant_groups_exact() -> None:
    weight = torch.full((16, 64), 0.25)
    torch.testing.assert_close(quantize_int4(weight).dequantize(), weight)


def loaded_linear(layer: ReplicatedLinear, weight: torch.Tensor, groups: Int4Groups | None) -> None:
    layer.weight_loader(layer.weight, attach_int4_groups(weight.clone(), groups) if groups else weight)


def test_small_batches_use_the_int4_copy_and_large_ones_the_dense_weight() -> None:
    # the int4 copy deliberately differs from the dense weight, so the output shows which one ran
    layer = ReplicatedLinear(64, 32, bias=True)
    groups = random_groups(32, 64)
    loaded_linear(layer, torch.zeros(32, 64), groups)
    layer.weight_loader(layer.bias, torch.arange(32.0))
    process_weights_after_loading(layer, AUTO)
    assert isinstance(layer.quant_method, Int4LinearMethod) and layer.quant_method.exact
    small, large = torch.randn(INT4_MAX_TOKENS, 64), torch.randn(INT4_MAX_TOKENS + 1, 64)
    torch.testing.assert_close(layer(small), F.linear(small, groups.dequantize(), layer.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(large), layer.bias.expand(INT4_MAX_TOKENS + 1, 32))


def test_in_batch_invariant_mode_every_token_count_uses_the_int4_copy() -> None:
    """row_invariant (batch-invariant mode): no switch to the dense weight at any size, so a token's result never
    depends on how many tokens share its step."""
    layer = ReplicatedLinear(64, 32, bias=False)
    groups = random_groups(32, 64)
    loaded_linear(layer, torch.zeros(32, 64), groups)  # dense zeros: the output shows which weight ran
    process_weights_after_loading(layer, LinearOptions(row_invariant=True))
    assert isinstance(layer.quant_method, Int4LinearMethod) and layer.quant_method.max_tokens is None
    large = torch.randn(300, 64)
    torch.testing.assert_close(layer(large), F.linear(large, groups.dequantize()), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(large[:1]), layer(large)[:1]) and torch.equal(layer(large[:33]), layer(large)[:33])


def test_generated_rows_take_the_int4_copy_and_prompt_rows_the_dense_weight() -> None:
    """int4 rows "generated" (quantization=auto's default): in a step that names its generated tokens, those rows
    are the int4 copy's and the others the dense weight's, each as computed alone (bitwise); a call outside such a
    step (or of other rows, or none generated) is dense."""
    layer = ReplicatedLinear(64, 32, bias=True)
    groups = random_groups(32, 64)
    dense = torch.randn(32, 64)  # another weight than the groups': the output shows which one ran
    loaded_linear(layer, dense, groups)
    layer.weight_loader(layer.bias, torch.arange(32.0))
    process_weights_after_loading(layer, LinearOptions(int4_rows="generated", prepack=False))
    assert isinstance(layer.quant_method, Int4LinearMethod) and layer.quant_method.rows == "generated"
    x = torch.randn(7, 64)
    mask = np.array([True, False, True, True, False, False, True])
    with forward_context(None, generated_rows=GeneratedRows.from_mask(mask)):
        mixed = layer(x)
        assert torch.equal(layer(x[:6]), F.linear(x[:6], dense, layer.bias))  # not the step's 7 rows: dense
    packed = layer.quant_method.packed  # its kernel (tested against the dequantized weights on its own)
    torch.testing.assert_close(packed.matmul(x), F.linear(x, groups.dequantize()), rtol=1e-5, atol=1e-5)
    assert torch.equal(mixed[mask], packed.matmul(x[mask]) + layer.bias)
    assert torch.equal(mixed[~mask], F.linear(x[~mask], dense, layer.bias))
    assert torch.equal(layer(x), F.linear(x, dense, layer.bias))  # no step: every row dense
    with forward_context(None, generated_rows=GeneratedRows.from_mask(np.zeros(7, dtype=bool))):
        assert torch.equal(layer(x), F.linear(x, dense, layer.bias))
    with forward_context(None, generated_rows=GeneratedRows.from_mask(np.ones(7, dtype=bool))):
        assert torch.equal(layer(x), packed.matmul(x) + layer.bias)


def test_small_rows_are_refused_in_batch_invariant_mode() -> None:
    layer = ReplicatedLinear(64, 32, bias=False)
    loaded_linear(layer, torch.zeros(32, 64), random_groups(32, 64))
    with pytest.raises(ValueError, match="depend on their batch"):
        process_weights_after_loading(layer, LinearOptions(int4_rows="small", row_invariant=True))


@pytest.mark.parametrize("shape", [(960, 576, 1), (576, 1536, 1), (49152 // 64, 576, 2)])
def test_the_int4_kernel_is_probed_row_invariant_for_smollm2_shapes(shape: tuple[int, int, int]) -> None:
    """What lets int4 copies into batch-invariant mode on this CPU (the default model's projections; the LM head's
    two-plane Q8_0 width, fewer rows)."""
    assert int4_rows_invariant(*shape, torch.bfloat16, torch.get_num_threads())


def test_a_layer_whose_int4_rows_vary_stays_dense_in_batch_invariant_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    import llmplug.layers.quantization as quantization

    monkeypatch.setattr(quantization, "int4_rows_invariant", lambda *shape: False)
    monkeypatch.setattr(quantization, "native_int4_available", lambda: False)  # torch's kernel: the one probed
    groups = random_groups(32, 64)
    methods = {}
    for mode, options in {"invariant": LinearOptions(row_invariant=True), "default": AUTO}.items():
        layer = ReplicatedLinear(64, 32, bias=False)
        loaded_linear(layer, groups.dequantize(), groups)
        process_weights_after_loading(layer, options)
        methods[mode] = layer.quant_method
    assert not isinstance(methods["invariant"], Int4LinearMethod)
    # outside the mode the probe is not asked: the int4 copy serves small calls
    assert isinstance(methods["default"], Int4LinearMethod) and methods["default"].max_tokens == INT4_MAX_TOKENS


def test_leading_dims_are_kept() -> None:
    layer = ReplicatedLinear(64, 16, bias=False)
    groups = random_groups(16, 64)
    loaded_linear(layer, groups.dequantize(), groups)
    process_weights_after_loading(layer, AUTO)
    x = torch.randn(1, 2, 64)
    assert layer(x).shape == (1, 2, 16)
    torch.testing.assert_close(layer(x), F.linear(x, groups.dequantize()), rtol=1e-5, atol=1e-5)


def test_fused_qkv_stages_each_shard_in_its_rows_in_any_order() -> None:
    layer = QKVParallelLinear(64, head_size=16, total_num_heads=2, total_num_kv_heads=1, bias=False)
    shards = {name: random_groups(rows, 64, seed=i) for i, (name, rows) in enumerate([("q", 32), ("k", 16), ("v", 16)])}
    for shard_id in ("v", "q", "k"):
        groups = shards[shard_id]
        layer.weight_loader(layer.weight, attach_int4_groups(groups.dequantize(), groups), shard_id)
    process_weights_after_loading(layer, AUTO)
    x = torch.randn(2, 64)
    full = torch.cat([shards[s].dequantize() for s in "qkv"])
    torch.testing.assert_close(layer.quant_method.packed.matmul(x), x @ full.T, rtol=1e-5, atol=1e-5)


def test_fused_layer_mixing_one_and_two_plane_shards_packs_two_planes() -> None:
    layer = MergedColumnParallelLinear(64, [16, 32], bias=False)
    gate, up = random_groups(16, 64, planes=2, seed=1), random_groups(32, 64, planes=1, seed=2)
    layer.weight_loader(layer.weight, attach_int4_groups(up.dequantize(), up), 1)
    layer.weight_loader(layer.weight, attach_int4_groups(gate.dequantize(), gate), 0)
    process_weights_after_loading(layer, AUTO)
    assert layer.quant_method.packed.num_planes == 2
    x = torch.randn(3, 64)
    expected = x @ torch.cat([gate.dequantize(), up.dequantize()]).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_row_parallel_layer_with_bias_uses_its_int4_copy() -> None:
    layer = RowParallelLinear(64, 16, bias=True)
    groups = random_groups(16, 64)
    loaded_linear(layer, groups.dequantize(), groups)
    layer.weight_loader(layer.bias, torch.randn(16))
    process_weights_after_loading(layer, AUTO)
    assert isinstance(layer.quant_method, Int4LinearMethod)
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), F.linear(x, groups.dequantize(), layer.bias), rtol=1e-5, atol=1e-5)


def test_auto_keeps_layers_dense_without_exact_groups_for_every_row() -> None:
    plain = ReplicatedLinear(64, 16, bias=False)
    loaded_linear(plain, torch.randn(16, 64), None)
    partial = MergedColumnParallelLinear(64, [16, 16], bias=False)
    groups = random_groups(16, 64)
    partial.weight_loader(partial.weight, attach_int4_groups(groups.dequantize(), groups), 0)
    partial.weight_loader(partial.weight, torch.randn(16, 64), 1)  # e.g. a Q6_K shard: no exact int4 form
    for layer in (plain, partial):
        process_weights_after_loading(layer, AUTO)
        assert layer.quant_method is DENSE
        assert not hasattr(layer.weight, "int4_staging")  # staging is freed either way


def test_int4_mode_quantizes_what_the_checkpoint_did_not_give_exactly() -> None:
    layer = MergedColumnParallelLinear(64, [16, 16], bias=False)
    exact, dense = random_groups(16, 64), torch.randn(16, 64)
    layer.weight_loader(layer.weight, attach_int4_groups(exact.dequantize(), exact), 0)
    layer.weight_loader(layer.weight, dense, 1)
    process_weights_after_loading(layer, FORCED)
    method = layer.quant_method
    assert isinstance(method, Int4LinearMethod) and not method.exact
    x = torch.randn(2, 64)
    expected = x @ torch.cat([exact.dequantize(), quantize_int4(dense).dequantize()]).T
    torch.testing.assert_close(method.packed.matmul(x), expected, rtol=1e-5, atol=1e-5)


def test_output_sizes_the_kernel_cannot_pack_stay_dense() -> None:
    layer = ReplicatedLinear(64, 8, bias=False)  # the CPU packing needs multiples of 16 rows
    groups = random_groups(8, 64)
    loaded_linear(layer, groups.dequantize(), groups)
    process_weights_after_loading(layer, AUTO)
    assert layer.quant_method is DENSE


def test_reloading_a_weight_drops_its_stale_int4_copy() -> None:
    layer = ReplicatedLinear(64, 16, bias=False)
    groups = random_groups(16, 64)
    loaded_linear(layer, groups.dequantize(), groups)
    process_weights_after_loading(layer, AUTO)
    new = torch.randn(16, 64)
    layer.weight_loader(layer.weight, new)  # e.g. an RL trainer pushing new weights
    x = torch.randn(1, 64)
    torch.testing.assert_close(layer(x), x @ new.T)


def tied_model(vocab: int = 48, hidden: int = 64) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed = VocabParallelEmbedding(vocab, hidden)
    with torch.device("meta"):
        head = ParallelLMHead(vocab, hidden)
    model.head = head.tie_weights(model.embed)
    return model


def test_tied_lm_head_packs_the_embedding_table_and_the_lookup_stays_dense() -> None:
    model = tied_model()
    groups = random_groups(48, 64, planes=2)
    table = groups.dequantize()
    model.embed.weight_loader(model.embed.weight, attach_int4_groups(table.clone(), groups))
    process_weights_after_loading(model, AUTO)
    assert isinstance(model.head.quant_method, Int4LinearMethod)
    assert not hasattr(model.embed, "quant_method")
    torch.testing.assert_close(model.embed(torch.tensor([3, 7])), table[[3, 7]])
    hidden = torch.randn(2, 64)
    torch.testing.assert_close(model.head.get_logits(hidden), hidden @ table.T, rtol=1e-5, atol=1e-5)
    new = torch.randn(48, 64)
    model.embed.weight_loader(model.embed.weight, new)  # reloading the table makes the head dense again
    torch.testing.assert_close(model.head.get_logits(hidden), hidden @ new.T)


def test_int4_mode_quantizes_a_dense_lm_head() -> None:
    model = tied_model()
    table = torch.randn(48, 64)
    model.embed.weight_loader(model.embed.weight, table)
    process_weights_after_loading(model, FORCED)
    method = model.head.quant_method
    assert isinstance(method, Int4LinearMethod) and not method.exact
    hidden = torch.randn(1, 64)
    expected = hidden @ quantize_int4(table).dequantize().T
    torch.testing.assert_close(model.head.get_logits(hidden), expected, rtol=1e-5, atol=1e-5)


def test_shards_with_different_group_sizes_are_a_load_error() -> None:
    layer = MergedColumnParallelLinear(64, [16, 16], bias=False)
    a, b = random_groups(16, 64, group_size=32), random_groups(16, 64, group_size=64)
    layer.weight_loader(layer.weight, attach_int4_groups(a.dequantize(), a), 0)
    with pytest.raises(ModelLoadError, match="group sizes 32 and 64"):
        layer.weight_loader(layer.weight, attach_int4_groups(b.dequantize(), b), 1)


def test_int4_mode_without_the_kernel_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import llmplug.layers.quantization as quantization

    monkeypatch.setattr(quantization, "int4_kernel_supported", lambda device_type, dtype: False)
    layer = ReplicatedLinear(64, 16, bias=False)
    loaded_linear(layer, torch.randn(16, 64), None)
    with pytest.raises(ModelLoadError, match="quantization=int4 needs"):
        process_weights_after_loading(layer, FORCED)
    process_weights_after_loading(layer, AUTO)  # auto just stays dense
    assert layer.quant_method is DENSE
