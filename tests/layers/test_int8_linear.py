"""W8A8 layers (quantization: int8): per-row quantization, the int8 matmul against an exact integer reference,
and rows that do not depend on how many rows share the call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmplug.layers.int8_linear as int8_linear
from llmplug.layers.int8_linear import Int8LinearMethod, int8_matmul_exact, quantize_rows
from llmplug.layers.kernels.amx_linear import amx_linear_enabled
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.quantization import LinearOptions, process_weights_after_loading

pytestmark = pytest.mark.skipif(not int8_matmul_exact("cpu"), reason="no exact int8 matmul on this CPU")
INT8 = LinearOptions(int4=False, int8=True)


def test_each_row_is_quantized_within_half_a_step_of_its_own_scale() -> None:
    x = torch.randn(5, 96) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1e4])[:, None]  # rows of very different size
    x[3] = 0.0  # an all-zero row stays zero
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 1)
    assert (q.abs().amax(-1)[[0, 1, 2, 4]] == 127).all() and (q[3] == 0).all()
    assert ((q.float() * scale - x).abs() <= scale / 2 + 1e-6 * x.abs()).all()


def test_layer_output_is_the_exact_integer_product_scaled() -> None:
    """Independent reference: the same quantized values multiplied in float64."""
    layer = ReplicatedLinear(96, 48, bias=True)
    layer.weight_loader(layer.weight, torch.randn(48, 96))
    layer.weight_loader(layer.bias, torch.randn(48))
    process_weights_after_loading(layer, INT8)
    method = layer.quant_method
    assert isinstance(method, Int8LinearMethod)
    x = torch.randn(7, 96)
    q, scale = quantize_rows(x)
    codes = (layer.weight.float() / method.scale[:, None]).round().clamp(-127, 127)  # the weight's int8 codes
    expected = (q.double() @ codes.double().T) * scale.double() * method.scale.double() + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=1e-6)
    # and within int8's error of the dense layer
    dense = F.linear(x, layer.weight, layer.bias)
    assert (layer(x) - dense).abs().max() < 0.05 * dense.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_and_among_300(dtype: torch.dtype) -> None:
    layer = ReplicatedLinear(576, 1536, bias=False).to(dtype)
    layer.weight_loader(layer.weight, torch.randn(1536, 576).to(dtype))
    process_weights_after_loading(layer, INT8)
    x = torch.randn(300, 576).to(dtype)
    every = layer(x)
    for rows in (1, 2, 7, 32, 33, 299):
        assert torch.equal(layer(x[:rows]), every[:rows]), f"{rows} rows"


def test_leading_dims_and_dtype_are_kept() -> None:
    layer = ReplicatedLinear(64, 32, bias=False).bfloat16()
    layer.weight_loader(layer.weight, torch.randn(32, 64).bfloat16())
    process_weights_after_loading(layer, INT8)
    y = layer(torch.randn(2, 3, 64).bfloat16())
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16


def test_without_an_exact_int8_matmul_int8_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import llmplug.layers.quantization as quantization
    from llmplug.core.errors import ModelLoadError

    monkeypatch.setattr(quantization, "int8_matmul_exact", lambda device_type: False)
    layer = ReplicatedLinear(64, 32, bias=False)
    with pytest.raises(ModelLoadError, match="quantization=int8 needs an exact int8 matmul"):
        process_weights_after_loading(layer, INT8)


@pytest.mark.skipif(not amx_linear_enabled(), reason="llmplug's AMX kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_the_amx_int8_kernel_gives_the_torch_ops_bits(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """On AMX the codes are packed for amx_int8_linear; its outputs equal torch._int_mm's path bit for bit (the same
    per-token quantization, exact int32 sums, the same float32 steps), for any rows and with a bias."""
    gen = torch.Generator().manual_seed(5)
    for n, k in ((48, 64), (100, 576), (576, 1536)):
        weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen).to(dtype)
        amx = Int8LinearMethod(weight)
        monkeypatch.setattr(int8_linear, "amx_linear_enabled", lambda: False)
        reference = Int8LinearMethod(weight)
        monkeypatch.undo()
        assert amx.packed is not None and reference.packed is None
        x = (torch.randn(70, k, generator=gen) * 3).to(dtype)
        x[1] = 0  # an all-zero row
        for rows in (1, 2, 16, 17, 33, 70):
            for b in (None, bias):
                assert torch.equal(amx.apply(None, x[:rows], b), reference.apply(None, x[:rows], b)), (n, k, rows)
    assert Int8LinearMethod(torch.randn(8, 96)).packed is None  # K not a multiple of 64: torch's int8 matmul
