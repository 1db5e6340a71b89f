"""Which quantization method a checkpoint is built with (`resolve_quantization`), and the errors that name what is
wrong and what is installed: at config time for a `quantization` that names nothing, at load time for a checkpoint
whose method is not installed or that `quantization` contradicts. After each error the same process loads a good
checkpoint and generates like transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from llmplug import LLM, SamplingParams
from llmplug.core.config import ModelConfig, load_config
from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginRegistry
from llmplug.quantization import GROUP, RUNTIME_MODES, checkpoint_quant_method, resolve_quantization
from llmplug.testing import save_tiny_checkpoint, tiny_config
from tests.engine.test_llm import generate_ids, hf_greedy

ENGINE = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": 4, "device": {"num_threads": 1}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 9], [200, 3, 41, 8]]
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return save_tiny_checkpoint(tiny_config(LlamaConfig), tmp_path_factory.mktemp("dense"))


def quantized_like(dense, folder: Path, quantization_config: dict) -> Path:
    """`dense`'s checkpoint whose config.json says it is quantized (the load stops before its tensors are read)."""
    shutil.copytree(dense.path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    return folder


def assert_a_good_load_works(dense) -> None:
    llm = LLM(str(dense.path), **ENGINE)
    try:
        assert generate_ids(llm, PROMPTS, GREEDY) == [hf_greedy(dense.hf_model, p, 6) for p in PROMPTS]
    finally:
        llm.shutdown()


# --- resolve_quantization itself -------------------------------------------------------------------------


def test_a_dense_checkpoint_has_no_method_whatever_runtime_mode():
    for mode in RUNTIME_MODES:
        config = ModelConfig(model="m", quantization=mode)
        assert resolve_quantization(SimpleNamespace(), config, PluginRegistry()) is None


def test_a_runtime_int4_or_int8_mode_on_a_quantized_checkpoint_is_refused():
    checkpoint = SimpleNamespace(quantization_config=GPTQ)
    for mode in ("int4", "int8"):
        with pytest.raises(ConfigError, match=rf"quantization='{mode}', but m is a 'gptq' checkpoint"):
            resolve_quantization(checkpoint, ModelConfig(model="m", quantization=mode), PluginRegistry())


def test_the_checkpoints_method_is_read_lowercased_from_its_quantization_config():
    assert checkpoint_quant_method(SimpleNamespace(quantization_config={"quant_method": "GPTQ", "bits": 4})) == (
        "gptq", {"quant_method": "GPTQ", "bits": 4})
    assert checkpoint_quant_method(SimpleNamespace(quantization_config=None)) is None
    with pytest.raises(ConfigError, match="has no quant_method"):
        checkpoint_quant_method(SimpleNamespace(quantization_config={"bits": 4}))


def test_the_in_tree_methods_are_registered_in_the_group():
    assert {"gptq", "awq", "compressed-tensors", "fp8"} <= set(PluginRegistry().names(GROUP))


# --- through the engine, each error followed by a good load -------------------------------------------------


def test_an_uninstalled_method_names_it_and_lists_the_installed_ones(dense, tmp_path):
    folder = quantized_like(dense, tmp_path / "ckpt", {"quant_method": "hqq-9000", "bits": 3})
    with pytest.raises(ConfigError, match=r"quantized with 'hqq-9000', which no installed llmplug.quantization "
                                          r"plugin implements; installed: .*awq.*gptq"):
        LLM(str(folder), **ENGINE)
    assert_a_good_load_works(dense)


def test_a_method_named_for_a_dense_checkpoint_is_refused(dense):
    with pytest.raises(ConfigError, match=r"quantization='gptq' asks for a quantized checkpoint's method, but .* has "
                                          r"no quantization_config in its config.json"):
        LLM(str(dense.path), quantization="gptq", **ENGINE)
    assert_a_good_load_works(dense)


def test_another_method_than_the_checkpoints_is_refused(dense, tmp_path):
    folder = quantized_like(dense, tmp_path / "gptq", GPTQ)
    with pytest.raises(ConfigError, match=r"quantization='awq', but .* is a 'gptq' checkpoint"):
        LLM(str(folder), quantization="awq", **ENGINE)
    assert_a_good_load_works(dense)


# --- at config time: a name that is neither a mode nor a method -----------------------------------------------


def test_the_quantization_flag_accepts_modes_and_installed_method_names():
    for name in (*RUNTIME_MODES, *PluginRegistry().names(GROUP)):
        assert load_config(cli={"--quantization": name}).config.model.quantization == name


def test_an_unknown_quantization_is_a_config_error_listing_modes_and_methods():
    with pytest.raises(ConfigError) as error:
        load_config(cli={"--quantization": "gtpq"})
    message = str(error.value)
    assert "model.quantization = 'gtpq' (from flag --quantization)" in message
    assert "none, auto, int4, int8" in message and all(m in message for m in ("awq", "compressed-tensors", "gptq"))
    with pytest.raises(ValueError, match="neither a mode"):  # a config built in code is checked too
        ModelConfig(quantization="gtpq")
