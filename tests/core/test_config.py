"""Config loading: sources and their precedence, aliases, dotted keys, files, errors, hooks, output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmplug.core import plugins
from llmplug.core.config import (
    ALIASES,
    FIELD_FLAGS,
    FIELD_PATHS,
    FLAG_PATHS,
    CacheConfig,
    EngineConfig,
    ResolvedConfig,
    format_config,
    load_config,
)
from llmplug.core.config_docs import markdown
from llmplug.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
TOY_HOOKS = REPO / "tests" / "plugins" / "toy_hooks"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- sources and precedence ------------------------------------------------------------------------


def test_no_source_gives_the_schema_defaults_all_marked_default():
    resolved = load_config()
    assert resolved.config == EngineConfig()
    assert resolved.sources == dict.fromkeys(FIELD_PATHS, "default")


def test_flags_override_file_which_overrides_kwargs(tmp_path):
    file = _write(tmp_path / "c.yaml", "cache: {block_size: 32}\nmax_num_seqs: 8\n")
    resolved = load_config(
        kwargs={"block_size": 16, "max_num_seqs": 4, "seed": 7},
        file=file,
        cli={"--block-size": 64},
    )
    config, sources = resolved.config, resolved.sources
    assert (config.cache.block_size, sources["cache.block_size"]) == (64, "flag --block-size")
    assert (config.scheduler.max_num_seqs, sources["scheduler.max_num_seqs"]) == (8, f"file {file}")
    assert (config.model.seed, sources["model.seed"]) == (7, "kwargs")
    assert sources["model.dtype"] == "default"


def test_order_lets_kwargs_beat_the_file(tmp_path):
    file = _write(tmp_path / "c.yaml", "block_size: 32\n")
    resolved = load_config(kwargs={"block_size": 8}, file=file, order=("file", "kwargs", "cli"))
    assert (resolved.config.cache.block_size, resolved.sources["cache.block_size"]) == (8, "kwargs")


def test_order_must_name_every_source_once():
    with pytest.raises(ConfigError, match="once"):
        load_config(order=("file", "kwargs"))


def test_plain_cli_keys_are_named_by_their_primary_flag():
    resolved = load_config(cli={"gpu_memory_utilization": 0.5})
    assert resolved.sources["cache.memory_fraction"] == "flag --memory-fraction"


# --- keys: aliases, dotted keys, sections -------------------------------------------------------------


@pytest.mark.parametrize(
    ("alias", "value", "path"),
    [
        ("num_gpu_blocks_override", 100, "cache.num_blocks"),
        ("gpu_memory_utilization", 0.5, "cache.memory_fraction"),
        ("load_format", "gguf", "load.format"),
        ("distributed_executor_backend", "ray", "parallel.executor"),
        ("guided_decoding_backend", "xgrammar", "decoding.guided_backend"),
        ("platform", "cpu", "device.platform"),
        ("model", "/models/m", "model.model"),
        ("max_model_len", 4096, "model.max_model_len"),
    ],
)
def test_a_vllm_alias_sets_its_field(alias, value, path):
    resolved = load_config(kwargs={alias: value})
    section, name = path.split(".")
    assert getattr(getattr(resolved.config, section), name) == value
    assert resolved.sources[path] == "kwargs"


def test_every_alias_names_a_real_field():
    assert set(ALIASES.values()) <= set(FIELD_PATHS)


def test_aliases_and_dotted_keys_work_in_files(tmp_path):
    file = _write(tmp_path / "c.yaml", "gpu_memory_utilization: 0.7\ncache.block_size: 8\nmodel: /m\n")
    config = load_config(file=file).config
    assert (config.cache.memory_fraction, config.cache.block_size, config.model.model) == (0.7, 8, "/m")


def test_dotted_keys_work_in_kwargs():
    assert load_config(kwargs={"device.platform": "cpu"}).config.device.platform == "cpu"


def test_a_section_object_overrides_only_the_fields_it_set(tmp_path):
    file = _write(tmp_path / "c.yaml", "cache: {memory_fraction: 0.5}\n")
    resolved = load_config(kwargs={"cache": CacheConfig(block_size=8)}, file=file)
    assert (resolved.config.cache.block_size, resolved.config.cache.memory_fraction) == (8, 0.5)


def test_one_field_twice_in_one_source_is_an_error():
    with pytest.raises(ConfigError, match=r"cache.block_size is set twice in kwargs \(as 'block_size' and 'cache.block_size'\)"):
        load_config(kwargs={"block_size": 8, "cache": {"block_size": 16}})


# --- files ---------------------------------------------------------------------------------------------


def test_yaml_toml_and_json_files_give_the_same_config(tmp_path):
    yaml_file = _write(tmp_path / "c.yml", "cache:\n  block_size: 32\ndevice:\n  platform: cpu\nmax_num_seqs: 4\n")
    toml_file = _write(tmp_path / "c.toml", 'max_num_seqs = 4\n[cache]\nblock_size = 32\n[device]\nplatform = "cpu"\n')
    json_file = _write(tmp_path / "c.json", '{"cache": {"block_size": 32}, "device.platform": "cpu", "max_num_seqs": 4}')
    configs = [load_config(file=f) for f in (yaml_file, toml_file, json_file)]
    assert configs[0].config == configs[1].config == configs[2].config
    assert configs[0].config.cache.block_size == 32
    assert [c.sources["cache.block_size"] for c in configs] == [f"file {f}" for f in (yaml_file, toml_file, json_file)]


def test_an_empty_yaml_file_changes_nothing(tmp_path):
    assert load_config(file=_write(tmp_path / "c.yaml", "# nothing yet\n")).config == EngineConfig()


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.yaml", "cache:\n  block_size: 8\n bad: [\n", r"bad\.yaml is not valid YAML at line 3"),
        ("bad.toml", "[cache]\nblock_size = = 8\n", r"bad\.toml is not valid TOML: .*line 2"),
        ("bad.json", '{\n  "cache": {"block_size": 8,}\n}', r"bad\.json is not valid JSON at line 2"),
    ],
)
def test_a_file_that_does_not_parse_names_file_and_line(tmp_path, name, text, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(file=_write(tmp_path / name, text))


def test_unknown_extension_missing_file_and_non_mapping_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown extension '\.ini'; use \.yaml"):
        load_config(file=_write(tmp_path / "c.ini", "x"))
    with pytest.raises(ConfigError, match=r"nope\.yaml cannot be read"):
        load_config(file=tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="must hold a mapping of config keys at the top, got list"):
        load_config(file=_write(tmp_path / "c.yaml", "- 1\n"))


# --- errors --------------------------------------------------------------------------------------------


def test_an_invalid_value_names_field_value_and_file(tmp_path):
    file = _write(tmp_path / "c.yaml", "cache:\n  block_size: -3\n")
    with pytest.raises(ConfigError) as error:
        load_config(file=file)
    assert str(error.value) == f"cache.block_size = -3 (from file {file}): Input should be greater than 0"


def test_every_invalid_value_is_reported_with_its_own_source():
    with pytest.raises(ConfigError) as error:
        load_config(kwargs={"dtype": "float8"}, cli={"--block-size": 0})
    message = str(error.value)
    assert "model.dtype = 'float8' (from kwargs): Input should be 'auto'" in message
    assert "cache.block_size = 0 (from flag --block-size)" in message


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"blok_size": 3}, r"unknown config key 'blok_size' \(from {src}\); did you mean 'block_size'"),
        ({"cache": {"blok_size": 3}}, r"unknown config key 'cache.blok_size' \(from {src}\); did you mean 'cache.block_size'"),
        ({"cahce": {"block_size": 3}}, r"unknown config key 'cahce' \(from {src}\); did you mean 'cache'"),
        ({"cache.blok_size": 3}, r"unknown config key 'cache.blok_size' \(from {src}\); did you mean 'cache.block_size'"),
        ({"gpu_memory_utilisation": 0.5}, r"unknown config key 'gpu_memory_utilisation' \(from {src}\); did you mean 'gpu_memory_utilization'"),
        ({"num_threads": 2}, r"unknown config key 'num_threads' \(from {src}\); did you mean 'device.num_threads'"),
    ],
)
def test_an_unknown_key_names_its_source_and_the_closest_key(tmp_path, data, expected):
    with pytest.raises(ConfigError, match=expected.format(src="kwargs")):
        load_config(kwargs=data)
    file = _write(tmp_path / "c.json", json.dumps(data))
    with pytest.raises(ConfigError, match=expected.format(src=f"file {file}".replace(".", r"\."))):
        load_config(file=file)


def test_a_section_given_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match=r"cache = 3 \(from kwargs\): section 'cache' must be a mapping"):
        load_config(kwargs={"cache": 3})


def test_an_unknown_flag_in_cli_suggests_the_closest_flag():
    with pytest.raises(ConfigError, match=r"unknown config key '--blok-size' \(from flag --blok-size\); did you mean '--block-size'"):
        load_config(cli={"--blok-size": 3})


# --- plugin hooks ----------------------------------------------------------------------------------------


def test_loading_a_config_leaves_the_process_registry_alone():
    before = plugins.get_registry()
    for apply_hooks in (True, False):
        load_config(kwargs={"plugins": {"enabled": ["some-dist"]}}, apply_hooks=apply_hooks)
        assert plugins.get_registry() is before


def test_a_malformed_plugins_prefer_key_names_its_source(tmp_path):
    file = _write(tmp_path / "c.yaml", "plugins: {prefer: {cuda: my-dist}}\n")
    with pytest.raises(ConfigError, match=rf"plugins.prefer .*\(plugins config from file {tmp_path}"):
        load_config(file=file)


def _install_toy_hooks(root: Path) -> None:
    """Make the example hooks plugin importable and discoverable, as pip would (module + dist-info)."""
    dist_info = root / "llmplug_example_toy_hooks-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: llmplug-example-toy-hooks\nVersion: 0.1.0\n")
    (dist_info / "entry_points.txt").write_text("[llmplug.hooks]\ntoy = llmplug_example_toy_hooks\n")
    (root / "llmplug_example_toy_hooks.py").write_text((TOY_HOOKS / "llmplug_example_toy_hooks.py").read_text())


def test_a_value_a_hook_changes_is_attributed_to_the_hook(tmp_path, monkeypatch):
    _install_toy_hooks(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    resolved = load_config(kwargs={"hf_overrides": {"toy_hook": 7}})
    assert resolved.config.scheduler.max_num_seqs == 7
    assert resolved.sources["scheduler.max_num_seqs"] == "hook llmplug_adjust_config"
    assert resolved.sources["model.hf_overrides"] == "kwargs"


def test_a_plugin_outside_the_allow_list_runs_no_hook(tmp_path, monkeypatch):
    _install_toy_hooks(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    resolved = load_config(kwargs={"hf_overrides": {"toy_hook": 7}, "plugins": {"enabled": ["other-dist"]}})
    assert resolved.config.scheduler.max_num_seqs == 256


def test_a_bad_value_from_a_hook_names_the_hook(tmp_path, monkeypatch):
    _install_toy_hooks(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"scheduler.max_num_seqs = -1 \(from hook llmplug_adjust_config\)"):
        load_config(kwargs={"hf_overrides": {"toy_hook": -1}})


# --- output and flags ---------------------------------------------------------------------------------------


def test_yaml_output_loads_back_to_the_same_config(tmp_path):
    odd = {"model": "dir with #hash", "tokenizer": "yes", "hf_overrides": {"rope": {"type": "x"}, "n": None},
           "plugins": {"enabled": ["a", "b"], "prefer": {"llmplug.loaders:x": "d"}}, "num_gpu_blocks_override": 12}
    resolved = load_config(kwargs=odd)
    text = format_config(resolved, "yaml")
    assert "  block_size: 16  # default\n" in text and "  num_blocks: 12  # kwargs\n" in text
    again = load_config(file=_write(tmp_path / "out.yaml", text)).config
    assert again == resolved.config


def test_json_output_has_config_and_sources():
    data = json.loads(format_config(load_config(kwargs={"block_size": 8}), "json"))
    assert data["config"]["cache"]["block_size"] == 8
    assert data["sources"]["cache.block_size"] == "kwargs"


def test_table_output_has_one_row_per_field():
    table = format_config(load_config(), "table")
    assert len(table.splitlines()) == len(FIELD_PATHS) + 1


def test_ambiguous_field_names_get_vllm_or_section_flags():
    assert FIELD_FLAGS["load.format"] == ("--load-format",)
    assert FIELD_FLAGS["parallel.executor"] == ("--distributed-executor-backend",)
    assert FIELD_FLAGS["model.model"] == ("--model",)
    assert FIELD_FLAGS["plugins.enabled"] == ("--plugins-enabled",)
    assert FIELD_FLAGS["cache.memory_fraction"] == ("--memory-fraction", "--gpu-memory-utilization")
    assert FLAG_PATHS["--no-enable-prefix-caching"] == "cache.enable_prefix_caching"


def test_every_field_has_a_flag():
    assert set(FIELD_FLAGS) == set(FIELD_PATHS)


def test_docs_config_md_is_generated_from_the_schema():
    assert (REPO / "docs" / "config.md").read_text(encoding="utf-8") == markdown(), (
        "docs/config.md is stale: run `python -m llmplug.core.config_docs > docs/config.md`"
    )


def test_resolved_config_is_frozen():
    resolved = load_config()
    assert isinstance(resolved, ResolvedConfig)
    with pytest.raises(AttributeError):
        resolved.config = EngineConfig()  # type: ignore[misc]
