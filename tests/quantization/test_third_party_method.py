"""A third-party quantization method (tests/plugins/toy_quantization, `quant_method: toy-int8`), pip-installed, is
found by its entry point alone (this test never imports it) and runs a quantized checkpoint through the engine like
transformers on the dequantized weights; `llmplug.testing.check_quantization_method` proves it and catches a method
whose parts disagree."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from llmplug import LLM
from llmplug.core.errors import ModelLoadError
from llmplug.core.plugins import PluginRegistry
from llmplug.quantization import GROUP
from llmplug.testing import save_tiny_checkpoint, tiny_config
from llmplug.testing.quantization import check_quantization_method, save_quantized_checkpoint
from tests.plugin_examples import example_site_fixtures

TOY_CONFIG = {"quant_method": "toy-int8", "bits": 8}


def int8_per_output(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Symmetric int8 per output row: the toy format's tensors and the weight they stand for."""
    scale = weight.abs().amax(dim=1).clamp_min(1e-8) / 127  # [out]
    qweight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return {"qweight": qweight, "weight_scale": scale.float()}, qweight.float() * scale[:, None]


site, installed = example_site_fixtures(["toy_quantization"])  # only this example, installed by pip


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A tiny Llama in the toy-int8 format (every linear layer but the LM head) and its dequantized reference."""
    tiny = save_tiny_checkpoint(tiny_config(LlamaConfig), tmp_path_factory.mktemp("llama"))
    return save_quantized_checkpoint(tiny, tmp_path_factory.mktemp("toy_int8"), TOY_CONFIG, int8_per_output)


def test_the_method_is_listed_from_its_entry_point_and_not_in_tree(installed):
    [info] = [i for i in PluginRegistry().infos(GROUP) if i.name == "toy-int8"]
    assert (info.distribution, info.builtin) == ("llmplug-example-toy-quantization", False)


def test_the_checkpoint_runs_with_the_installed_method_like_transformers_on_its_dequantized_weights(
    installed, quantized
):
    report = check_quantization_method(quantized.path, quantized.hf_model)
    assert (report.quant_method, report.distribution) == ("toy-int8", "llmplug-example-toy-quantization")
    # every linear layer of both decoder layers: qkv, o, gate_up, down
    assert {check.prefix.split(".", 3)[-1] for check in report.layers} == {
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    assert len(report.layers) == 8 and {check.method for check in report.layers} == {"ToyInt8Method"}
    assert report.row_invariant is True and report.max_logprob_diff <= 1e-4
    with safe_open(quantized.path / "model.safetensors", "pt") as stored:  # no dense copy of a quantized weight
        names = set(stored.keys())
    assert "model.layers.0.mlp.down_proj.qweight" in names and "model.layers.0.mlp.down_proj.weight" not in names


def test_a_setting_the_method_does_not_implement_is_a_load_error_naming_it(installed, quantized, tmp_path):
    folder = tmp_path / "bits4"
    shutil.copytree(quantized.path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["bits"] = 4
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"toy-int8: bits=4 is not implemented"):
        LLM(str(folder), dtype="float32", skip_tokenizer_init=True)


def test_the_check_fails_against_a_reference_that_is_not_the_dequantized_weights(installed, quantized, tmp_path):
    dense = save_tiny_checkpoint(tiny_config(LlamaConfig), tmp_path / "dense")  # same seed: the unquantized weights
    with pytest.raises(AssertionError, match="differ from transformers"):
        check_quantization_method(quantized.path, dense.hf_model)


def test_the_check_fails_when_apply_and_dequantize_disagree(installed, quantized, monkeypatch):
    config_class = PluginRegistry().load(GROUP, "toy-int8")  # through the entry point, as the engine gets it
    method_class = type(config_class.from_config(TOY_CONFIG).linear_method(None, "model.layers.0.mlp.down_proj"))
    honest = method_class.apply  # a kernel 1% off the weight the method says it holds
    monkeypatch.setattr(method_class, "apply", lambda self, layer, x, bias: honest(self, layer, x, bias) * 1.01)
    with pytest.raises(AssertionError, match=r"apply differs from x @ dequantize\(layer\)\^T"):
        check_quantization_method(quantized.path, quantized.hf_model)


def test_a_method_not_row_invariant_is_reported_not_checked(installed, quantized, monkeypatch):
    config_class = PluginRegistry().load(GROUP, "toy-int8")
    method_class = type(config_class.from_config(TOY_CONFIG).linear_method(None, "model.layers.0.mlp.down_proj"))
    monkeypatch.setattr(method_class, "row_invariant", False)
    assert check_quantization_method(quantized.path, quantized.hf_model, max_new_tokens=2).row_invariant is None


def test_a_method_claiming_row_invariance_that_it_lacks_fails(installed, quantized, monkeypatch):
    config_class = PluginRegistry().load(GROUP, "toy-int8")
    method_class = type(config_class.from_config(TOY_CONFIG).linear_method(None, "model.layers.0.mlp.down_proj"))
    honest = method_class.apply
    # a kernel whose rounding depends on the batch: the rows of a call of several rows are computed in float16
    batch_dependent = lambda self, layer, x, bias: (  # noqa: E731
        honest(self, layer, x, bias) if x.reshape(-1, x.shape[-1]).shape[0] == 1
        else honest(self, layer, x, bias).half().float())
    monkeypatch.setattr(method_class, "apply", batch_dependent)
    with pytest.raises(AssertionError, match="declares row_invariant, but row 0 of a 2-row call differs"):
        check_quantization_method(quantized.path, quantized.hf_model, layer_rtol=1e-2)
