"""The `llmplug` command: --version, config (flags, files, round trip, errors), plugins, no torch import."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import llmplug
from llmplug.core.config import EngineConfig, load_config
from llmplug.entrypoints.cli import main
from llmplug.entrypoints.engine_args import add_engine_args, config_from_args

BACKENDS_YAML = """\
device:
  platform: cpu
load:
  format: dummy
parallel:
  executor: multiproc
decoding:
  guided_backend: xgrammar
"""


def _llmplug(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real command in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "llmplug.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd)


def _config_json(capsys, *args: str) -> dict:
    assert main(["config", *args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- --version and usage -----------------------------------------------------------------------------------


def test_version_prints_llmplugs_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"llmplug {llmplug.__version__}\n"


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "config" in capsys.readouterr().err


# --- llmplug config ----------------------------------------------------------------------------------------


def test_flags_override_the_config_file(tmp_path, capsys):
    file = tmp_path / "c.yaml"
    file.write_text("cache: {block_size: 32}\nmax_num_seqs: 8\n")
    data = _config_json(capsys, "--config", str(file), "--block-size", "64")
    assert data["config"]["cache"]["block_size"] == 64
    assert data["sources"]["cache.block_size"] == "flag --block-size"
    assert data["sources"]["scheduler.max_num_seqs"] == f"file {file}"


def test_alias_bool_json_list_and_none_flags(capsys):
    data = _config_json(
        capsys, "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "--hf-overrides", '{"rope_theta": 1e6}',
        "--plugins-enabled", "a,b", "--max-model-len", "none", "--load-format", "gguf",
    )
    config, sources = data["config"], data["sources"]
    assert (config["cache"]["memory_fraction"], sources["cache.memory_fraction"]) == (0.5, "flag --gpu-memory-utilization")
    assert (config["cache"]["enable_prefix_caching"], sources["cache.enable_prefix_caching"]) == (False, "flag --no-enable-prefix-caching")
    assert config["model"]["hf_overrides"] == {"rope_theta": 1e6}
    assert config["plugins"]["enabled"] == ["a", "b"]
    assert config["model"]["max_model_len"] is None and sources["model.max_model_len"] == "flag --max-model-len"
    assert config["load"]["format"] == "gguf"


def test_a_bad_flag_value_names_field_and_flag(capsys):
    assert main(["config", "--block-size", "abc"]) == 2
    assert capsys.readouterr().err.startswith("llmplug: error: cache.block_size = 'abc' (from flag --block-size): Input should be a valid integer")


def test_bad_json_in_a_flag_names_the_flag(capsys):
    assert main(["config", "--hf-overrides", "{oops"]) == 2
    assert "--hf-overrides '{oops': not valid JSON" in capsys.readouterr().err


def test_an_unknown_flag_suggests_the_closest(capsys):
    assert main(["config", "--blok-size", "8"]) == 2
    assert capsys.readouterr().err == "llmplug: error: unknown flag --blok-size for 'llmplug config'; did you mean --block-size?\n"


def test_model_positional_sets_the_same_field_as_model_flag():
    parser = add_engine_args(argparse.ArgumentParser(), model_positional=True)
    resolved = config_from_args(parser.parse_args(["/models/m", "--block-size", "8"]))
    assert (resolved.config.model.model, resolved.sources["model.model"]) == ("/models/m", "flag --model")
    assert config_from_args(parser.parse_args(["--model", "/x"])).config.model.model == "/x"


def test_extra_kwargs_rank_below_file_and_flags(tmp_path):
    file = tmp_path / "c.toml"
    file.write_text("[cache]\nblock_size = 32\n")
    parser = add_engine_args(argparse.ArgumentParser())
    resolved = config_from_args(parser.parse_args(["--config", str(file), "--seed", "3"]), {"block_size": 8, "seed": 1, "dtype": "float32"})
    config = resolved.config
    assert (config.cache.block_size, config.model.seed, config.model.dtype) == (32, 3, "float32")


def test_backends_chosen_by_name_round_trip_through_llmplug_config(tmp_path):
    file = tmp_path / "backends.yaml"
    file.write_text(BACKENDS_YAML)
    first = _llmplug("config", "--config", str(file), "--format", "yaml")
    assert first.returncode == 0, first.stderr
    assert f"  platform: cpu  # file {file}\n" in first.stdout
    saved = tmp_path / "saved.yaml"
    saved.write_text(first.stdout)
    second = _llmplug("config", "--config", str(saved), "--format", "json")
    assert second.returncode == 0, second.stderr
    config = EngineConfig.model_validate(json.loads(second.stdout)["config"])
    assert config == load_config(file=file).config
    assert (config.device.platform, config.load.format, config.parallel.executor, config.decoding.guided_backend) == (
        "cpu", "dummy", "multiproc", "xgrammar")


def test_a_wrong_value_in_a_config_file_is_one_line_with_path_and_field(tmp_path):
    file = tmp_path / "backends.yaml"
    file.write_text(BACKENDS_YAML.replace("executor: multiproc", "executor: [multiproc]"))
    result = subprocess.run([Path(sys.executable).with_name("llmplug"), "config", "--config", str(file)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == (f"llmplug: error: parallel.executor = ['multiproc'] (from file {file}): "
                             "Input should be a valid string\n")


def test_an_unknown_key_in_a_config_file_suggests_the_closest(tmp_path, capsys):
    file = tmp_path / "c.yaml"
    file.write_text("load:\n  fromat: dummy\n")
    assert main(["config", "--config", str(file)]) == 2
    assert capsys.readouterr().err == (f"llmplug: error: unknown config key 'load.fromat' (from file {file}); "
                                       "did you mean 'load.format'?\n")


# --- llmplug plugins ---------------------------------------------------------------------------------------


def test_plugins_lists_every_in_tree_platform(capsys):
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["GROUP", "NAME", "DISTRIBUTION", "VERSION", "USABLE"]
    platforms = {line.split()[1] for line in lines[1:] if line.startswith("llmplug.platforms ")}
    assert {"cpu", "cuda", "rocm", "tpu", "xpu"} <= platforms


def test_plugins_json_filtered_by_group(capsys):
    assert main(["plugins", "--group", "platforms", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and {row["group"] for row in rows} == {"llmplug.platforms"}
    assert {"group", "name", "distribution", "version", "usable", "reason"} <= set(rows[0])


def test_plugins_lists_the_in_tree_quantization_methods_usable_or_why_not(capsys):
    assert main(["plugins", "--group", "quantization", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert {"gptq", "awq", "compressed-tensors", "fp8"} <= set(rows)
    assert {row["group"] for row in rows.values()} == {"llmplug.quantization"}
    assert all(row["distribution"] == "llmplug" and (row["usable"] or row["reason"]) for row in rows.values())


def test_plugins_with_an_unknown_group_suggests_one(capsys):
    assert main(["plugins", "--group", "llmplug.platfroms"]) == 2
    assert "did you mean 'llmplug.platforms'?" in capsys.readouterr().err


# --- no torch ----------------------------------------------------------------------------------------------


def test_version_config_and_plugins_do_not_import_torch(tmp_path):
    script = (
        "import sys\n"
        "from llmplug.entrypoints.cli import main\n"
        "codes = [main(['--version']), main(['config', '--platform', 'cpu']), main(['plugins'])]\n"
        "assert codes == [0, 0, 0], codes\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr


def test_plugins_probe_says_why_a_platform_is_not_usable_here():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "llmplug.entrypoints.cli", "plugins", "--probe", "--json"],
                         capture_output=True, text=True, check=True).stdout
    rows = {r["name"]: r for r in json.loads(out) if r["group"] == "llmplug.platforms"}
    assert rows["cpu"]["usable"] is True
    assert rows["cuda"]["usable"] is False and "CUDA" in rows["cuda"]["reason"]


# --- llmplug models ----------------------------------------------------------------------------------------


def test_models_lists_every_registered_architecture_with_family_and_features(capsys):
    from importlib.metadata import distribution

    assert main(["models", "--json"]) == 0
    rows = {row["architecture"]: row for row in json.loads(capsys.readouterr().out)}
    registered = {ep.name for ep in distribution("llmplug").entry_points if ep.group == "llmplug.models"}
    assert registered <= set(rows)
    assert rows["GemmaForCausalLM"]["family"] == "gemma" and rows["Gemma2ForCausalLM"]["family"] == "gemma"
    assert rows["LlamaForCausalLM"]["kind"] == "generate" and rows["BertModel"]["kind"] == "pooling"
    assert rows["Qwen3ForSequenceClassification"]["kind"] == "pooling"
    assert {k: rows["LlamaForCausalLM"][k] for k in ("tp", "pp", "gguf", "int4", "error")} == {
        "tp": True, "pp": True, "gguf": True, "int4": True, "error": ""}
    from llmplug.loaders.gguf_config import ARCHITECTURES

    gguf = {arch.hf_architecture for arch in ARCHITECTURES.values()}
    assert {name for name, row in rows.items() if row["gguf"]} == gguf & set(rows)
    assert main(["models"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header == ["ARCHITECTURE", "FAMILY", "KIND", "IMPL", "TP", "PP", "GGUF", "INT4", "DISTRIBUTION"]
    assert {row["impl"] for row in rows.values()} == {"native"}


def test_models_says_which_architectures_run_through_the_transformers_backend():
    from llmplug.entrypoints import models_list

    rows = {row["architecture"]: row for row in models_list.model_rows(transformers_types=["bitnet", "bart", "llama", "apertus1p5_text"])}
    assert rows["LlamaForCausalLM"]["impl"] == "native"  # native wins: listed once
    assert (rows["BitNetForCausalLM"]["impl"], rows["BitNetForCausalLM"]["error"]) == ("transformers", "")
    assert (rows["BitNetForCausalLM"]["tp"], rows["Apertus1p5TextForCausalLM"]["tp"]) == (False, True)  # no plan / plan
    assert rows["BartForCausalLM"]["impl"] == "-"
    assert "does not support the attention interface" in rows["BartForCausalLM"]["error"]
    table = models_list._table(list(rows.values())).splitlines()
    assert "error: transformers' BartForCausalLM does not support" in next(r for r in table if r.startswith("BartFor"))
