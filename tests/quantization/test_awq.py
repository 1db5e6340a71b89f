"""AWQ (GEMM) checkpoints (llmplug.quantization.awq) packed by AutoAWQ itself, against transformers computing with
the weights AutoAWQ's own `dequantize_gemm` decodes them to.

AutoAWQ's package `__init__` imports its whole quantizer (datasets, ...), so the test imports only its linear
layer and packing modules, under a bare `awq` package.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from llmplug.core.errors import ModelLoadError
from llmplug.layers.quantization import int4_kernel_supported
from llmplug.quantization.awq import AWQConfig
from tests.loaders.parity import hf_greedy, hf_logits, load_model, our_greedy, our_logits

from .checkpoints import TinyCheckpoint, held_bytes, quantize_checkpoint, rtn_groups, tiny_llama

pytestmark = pytest.mark.skipif(not int4_kernel_supported("cpu", torch.float32), reason="no CPU int4 kernel here")
ATOL = 1e-3  # as for GPTQ (test_gptq.py): an ulp per weight vs > 0.05 for a wrong nibble order or zero


def _autoawq() -> tuple[type, object]:
    """AutoAWQ's WQLinear_GEMM and dequantize_gemm, without running `awq/__init__`."""
    if "awq" not in sys.modules:
        spec = importlib.util.find_spec("awq")
        if spec is None:
            pytest.skip("autoawq is not installed")
        package = types.ModuleType("awq")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["awq"] = package
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    return WQLinear_GEMM, dequantize_gemm


def awq_quantizer(group_size: int):
    """Quantize (asymmetric RTN, as AutoAWQ's pseudo_quantize_tensor) and pack with WQLinear_GEMM.from_linear."""
    wq_linear, dequantize_gemm = _autoawq()

    def quantize(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, scale, zero = rtn_groups(weight, 4, group_size, sym=False)
        scales, zeros = scale.float().t(), zero.float().t()  # [G, N]
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        expand = lambda t: t.repeat_interleave(group_size, 1)  # noqa: E731  [N, G] -> [N, K]
        with torch.no_grad():  # AutoAWQ packs the fake-quantized weight: (q - z) s
            linear.weight.copy_((q - expand(zero)) * expand(scales.t()))
        packed = wq_linear.from_linear(linear, 4, group_size, scales=scales, zeros=zeros)
        tensors = {f"{name}.qweight": packed.qweight, f"{name}.qzeros": packed.qzeros,
                   f"{name}.scales": packed.scales.contiguous()}
        decoded = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4, group_size)  # [K, N]
        return tensors, decoded.t()

    return quantize


def awq_config(group_size: int = 128, **extra: object) -> dict[str, object]:
    """The quantization_config AutoAWQ writes."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"} | extra


def awq_checkpoint(path: Path, group_size: int = 128, skip: tuple[str, ...] = ()) -> TinyCheckpoint:
    checkpoint = tiny_llama(path)
    config = awq_config(group_size, modules_to_not_convert=list(skip) or None)
    quantize_checkpoint(checkpoint, awq_quantizer(group_size), config, skip=skip)
    return checkpoint


@pytest.mark.parametrize("group_size", [128, 64])
def test_awq_logits_and_greedy_tokens_match_transformers_on_autoawqs_decoded_weights(
    tmp_path: Path, group_size: int
) -> None:
    checkpoint = awq_checkpoint(tmp_path, group_size)
    model = load_model(tmp_path, "safetensors")
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.weight is None and "int4" in repr(layer.quant_method)
    torch.testing.assert_close(our_logits(model), hf_logits(checkpoint.hf_model), atol=ATOL, rtol=0)
    del model
    gc.collect()
    assert our_greedy(tmp_path, "auto") == hf_greedy(checkpoint.hf_model)


def test_weights_stay_packed_within_1_3x_of_the_checkpoint_bytes(tmp_path: Path) -> None:
    awq_checkpoint(tmp_path, group_size=128)
    held, file = held_bytes(load_model(tmp_path, "safetensors")), (tmp_path / "model.safetensors").stat().st_size
    assert held <= 1.3 * file, f"{held} bytes held for a {file}-byte checkpoint"


def test_modules_to_not_convert_stay_dense(tmp_path: Path) -> None:
    checkpoint = awq_checkpoint(tmp_path, skip=("down_proj",))
    model = load_model(tmp_path, "safetensors")
    assert model.model.layers[0].mlp.down_proj.weight is not None
    assert model.model.layers[0].mlp.gate_up_proj.weight is None
    torch.testing.assert_close(our_logits(model), hf_logits(checkpoint.hf_model), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("setting", "value"), [("version", "gemv"), ("version", "marlin"), ("bits", 3),
                                                  ("zero_point", False), ("group_size", 16)])
def test_other_versions_and_settings_are_refused_by_name(setting: str, value: object) -> None:
    with pytest.raises(ModelLoadError, match=setting):
        AWQConfig.from_config(awq_config() | {setting: value})
    assert AWQConfig.from_config(awq_config()).group_size == 128


def test_awq_passes_llmplugs_quantization_method_check(tmp_path: Path) -> None:
    from llmplug.testing.quantization import check_quantization_method

    checkpoint = awq_checkpoint(tmp_path, group_size=64)
    report = check_quantization_method(tmp_path, checkpoint.hf_model, atol=ATOL)
    assert report.quant_method == "awq" and len(report.layers) == 8
