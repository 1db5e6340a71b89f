"""compressed-tensors checkpoints (llmplug.quantization.compressed_tensors) written by the compressed-tensors
package's own compressors, against transformers loading the same folder (its CompressedTensorsHfQuantizer
decompresses the weights; on the CPU it cannot run the compressed int8 layers, and its decompressed model computes
without activation quantization, so for W8A8 the reference's linear inputs are fake-quantized by
compressed-tensors' own `calculate_qparams` and `fake_quantize`, as the format's forward does)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from llmplug.core.errors import ModelLoadError
from llmplug.layers.quantization import int4_kernel_supported
from llmplug.quantization.compressed_tensors import CompressedTensorsConfig
from tests.loaders.parity import hf_greedy, hf_logits, load_model, our_greedy, our_logits

from .checkpoints import TinyCheckpoint, held_bytes, quantize_checkpoint, tiny_llama

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

pytestmark = pytest.mark.skipif(not int4_kernel_supported("cpu", torch.float32), reason="no CPU int4 kernel here")
# weight-only: as for GPTQ (test_gptq.py), an ulp per weight against > 0.05 for a wrong group, zero or packing
ATOL = 1e-3


def ct_quantizer(scheme: QuantizationScheme, fmt: str):
    """Scales and zero points by compressed-tensors' calculate_qparams (min / max, as its minmax observer), the
    tensors by its compressor for `fmt`; the decoded weight is only a placeholder (transformers is the truth)."""
    compressor = BaseCompressor.get_value_from_registry(fmt)
    args = scheme.weights

    def quantize(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = weight.shape
        size = args.group_size if args.strategy == "group" else k
        groups = weight.reshape(n, k // size, size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        state = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            state["input_scale"] = torch.tensor([static_input_scale(name)])
        return {f"{name}.{key}": value.contiguous() for key, value in state.items()}, weight

    return quantize


def static_input_scale(name: str) -> float:
    """A calibrated per-tensor input scale: one per input, so q, k, v (and gate, up) share theirs."""
    return 0.03 if name.endswith(("o_proj", "down_proj")) else 0.025


def quantize_linear_inputs(model: torch.nn.Module, args: QuantizationArgs) -> None:
    """Fake-quantize every linear input but the LM head's, as compressed-tensors' forward does for `args`."""

    def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], name: str) -> tuple[torch.Tensor]:
        x = inputs[0].reshape(-1, inputs[0].shape[-1])  # [T, K]
        if args.dynamic:
            scale, zero = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), args)
        else:
            scale, zero = torch.tensor([static_input_scale(name)]), torch.zeros(1)
        return (fake_quantize(x, scale, zero, args).reshape(inputs[0].shape),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(lambda m, i, name=name: hook(m, i, name))


def ct_checkpoint(path: Path, scheme: QuantizationScheme, fmt: str) -> TinyCheckpoint:
    """A tiny compressed-tensors Llama; its reference is transformers' own load of the folder."""
    from transformers import AutoModelForCausalLM
    from transformers import CompressedTensorsConfig as HfConfig

    checkpoint = tiny_llama(path)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                                quantization_status="compressed")
    quantize_checkpoint(checkpoint, ct_quantizer(scheme, fmt), config.model_dump(mode="json"))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=HfConfig(
        run_compressed=False))
    if scheme.input_activations is not None:
        quantize_linear_inputs(reference, scheme.input_activations)
    return TinyCheckpoint(path, reference.eval())


def scheme(bits: int = 4, strategy: str = "group", group_size: int | None = 32, symmetric: bool = True,
           inputs: QuantizationArgs | None = None) -> QuantizationScheme:
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                               group_size=group_size if strategy == "group" else None)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)


WEIGHT_ONLY = [
    pytest.param(scheme(group_size=32), "pack-quantized", id="w4a16-g32-sym"),
    pytest.param(scheme(group_size=128, symmetric=False), "pack-quantized", id="w4a16-g128-asym"),
    pytest.param(scheme(strategy="channel"), "pack-quantized", id="w4a16-channel-sym"),
    pytest.param(scheme(strategy="channel", symmetric=False), "pack-quantized", id="w4a16-channel-asym"),
    pytest.param(scheme(bits=8, group_size=32), "pack-quantized", id="w8a16-g32-sym"),
    pytest.param(scheme(bits=8, strategy="channel"), "int-quantized", id="w8a16-int8-channel"),
]


@pytest.mark.parametrize(("weights_scheme", "fmt"), WEIGHT_ONLY)
def test_weight_only_schemes_match_transformers_loading_the_same_folder(tmp_path: Path, weights_scheme, fmt) -> None:
    checkpoint = ct_checkpoint(tmp_path, weights_scheme, fmt)
    model = load_model(tmp_path, "safetensors")
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.weight is None and "int4" in repr(layer.quant_method)
    assert model.lm_head.weight.dtype == torch.float32  # ignored: dense
    torch.testing.assert_close(our_logits(model), hf_logits(checkpoint.hf_model), atol=ATOL, rtol=0)
    del model
    gc.collect()
    assert our_greedy(tmp_path, "auto") == hf_greedy(checkpoint.hf_model)


@pytest.mark.parametrize(("weights_scheme", "fmt"), [
    pytest.param(scheme(group_size=128), "pack-quantized", id="w4a16"),
    pytest.param(scheme(bits=8, strategy="channel", inputs=QuantizationArgs(num_bits=8, type="int", dynamic=True,
                                                                           strategy="token")), "int-quantized",
                 id="w8a8"),
])
def test_weights_stay_packed_within_1_3x_of_the_checkpoint_bytes(tmp_path: Path, weights_scheme, fmt) -> None:
    ct_checkpoint(tmp_path, weights_scheme, fmt)
    held, file = held_bytes(load_model(tmp_path, "safetensors")), (tmp_path / "model.safetensors").stat().st_size
    assert held <= 1.3 * file, f"{held} bytes held for a {file}-byte checkpoint"


# W8A8 rounds every linear input to int8 steps (0.025 for the static scale): a float32 difference upstream (attention,
# norms) that moves one activation across a rounding boundary moves it a whole step, so the logits differ by up to
# ~0.05 (measured: 0.043 static, less per token) while each layer alone agrees to 2e-6; an input scale off by 2%
# moves them by 0.2, so 0.1 still catches a wrong scale or rounding rule
W8A8_ATOL = 0.1


@pytest.mark.parametrize("dynamic", [True, False], ids=["per-token", "static"])
def test_int_quantized_w8a8_keeps_int8_weights_and_matches_transformers(tmp_path: Path, dynamic: bool) -> None:
    inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=dynamic,
                              strategy="token" if dynamic else "tensor")
    checkpoint = ct_checkpoint(tmp_path, scheme(bits=8, strategy="channel", inputs=inputs), "int-quantized")
    model = load_model(tmp_path, "safetensors")
    method = model.model.layers[0].mlp.down_proj.quant_method
    assert method.weight_t.dtype == torch.int8
    torch.testing.assert_close(our_logits(model), hf_logits(checkpoint.hf_model), atol=W8A8_ATOL, rtol=0)
    del model
    gc.collect()
    assert our_greedy(tmp_path, "auto") == hf_greedy(checkpoint.hf_model)


def test_float_quantized_checkpoints_load_through_the_fp8_method(tmp_path: Path) -> None:
    pytest.importorskip("llmplug.quantization.fp8")
    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    fp8 = QuantizationScheme(targets=["Linear"], weights=weights)
    checkpoint = ct_checkpoint(tmp_path, fp8, "float-quantized")
    model = load_model(tmp_path, "safetensors")
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn  # stays fp8
    torch.testing.assert_close(our_logits(model), hf_logits(checkpoint.hf_model), atol=ATOL, rtol=0)


def _config(**group: object) -> dict[str, object]:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights} | group}}


@pytest.mark.parametrize(("change", "named"), [
    (dict(format="marlin-24"), "marlin-24"),
    (dict(format="nvfp4-pack-quantized"), "nvfp4-pack-quantized"),
    (dict(weights={"num_bits": 3, "type": "int", "strategy": "group", "group_size": 128}), "num_bits=3"),
    (dict(weights={"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "group"}),
     "actorder"),
    (dict(output_activations={"num_bits": 8, "type": "int"}), "output_activations"),
])
def test_unimplemented_formats_and_settings_are_refused_by_name(change: dict, named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        CompressedTensorsConfig.from_config(_config(**change))
    assert CompressedTensorsConfig.from_config(_config()).ignore == ("lm_head",)


def test_float_quantized_goes_to_the_fp8_method_or_says_it_is_missing() -> None:
    fp8 = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}, "format": "float-quantized"}
    config = CompressedTensorsConfig.from_config(_config(**fp8))
    try:
        from llmplug.quantization.fp8 import compressed_tensors_fp8_method  # noqa: F401
    except ImportError:
        with pytest.raises(ModelLoadError, match="compressed_tensors_fp8_method"):
            config.linear_method(None, "model.layers.0.mlp.down_proj")
    else:
        assert config.linear_method(None, "model.layers.0.mlp.down_proj") is not None


def test_dense_format_and_ignored_layers_stay_dense() -> None:
    config = CompressedTensorsConfig.from_config(_config(format="dense"))
    assert config.linear_method(None, "model.layers.0.self_attn.qkv_proj") is None
    ignoring = CompressedTensorsConfig.from_config(_config() | {"ignore": ["re:.*mlp.*"]})
    assert ignoring.linear_method(None, "model.layers.0.mlp.gate_up_proj") is None
    assert ignoring.linear_method(None, "model.layers.0.self_attn.qkv_proj") is not None


@pytest.mark.parametrize("weights_scheme", [scheme(strategy="channel", symmetric=False),
                                            scheme(bits=8, strategy="channel", inputs=QuantizationArgs(
                                                num_bits=8, type="int", symmetric=True, dynamic=True,
                                                strategy="token"))], ids=["w4a16-channel-asym", "w8a8"])
def test_compressed_tensors_passes_llmplugs_quantization_method_check(tmp_path: Path, weights_scheme) -> None:
    from llmplug.testing.quantization import check_quantization_method

    fmt = "int-quantized" if weights_scheme.input_activations is not None else "pack-quantized"
    checkpoint = ct_checkpoint(tmp_path, weights_scheme, fmt)
    atol = ATOL if fmt == "pack-quantized" else W8A8_ATOL
    # W8A8's apply quantizes x: against x @ dequantize^T it differs by its activation rounding (~1/255 of |x|)
    report = check_quantization_method(tmp_path, checkpoint.hf_model, atol=atol,
                                       layer_rtol=1e-5 if fmt == "pack-quantized" else 2e-2)
    assert report.quant_method == "compressed-tensors" and len(report.layers) == 8
